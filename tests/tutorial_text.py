"""RabbitMQ's classic mirroring tutorial for pika as two scripts (a publisher and a consumer),
the import line and the port being the only things a test may change. README.md shows the same
publisher."""

_PUBLISHER = """\
{import_line}

connection = pika.BlockingConnection(pika.ConnectionParameters('localhost', {port}))
channel = connection.channel()
channel.queue_declare(queue='my_mirrored_queue', durable=True)
channel.basic_publish(exchange='', routing_key='my_mirrored_queue', body='Hello, mirrored world!')
connection.close()
"""

_CONSUMER = """\
{import_line}

connection = pika.BlockingConnection(pika.ConnectionParameters('localhost', {port}))
channel = connection.channel()

def callback(ch, method, properties, body):
    print(f" [x] Received {{body.decode()}}")

channel.basic_consume(queue='my_mirrored_queue', on_message_callback=callback, auto_ack=True)
channel.start_consuming()
"""

LINE = " [x] Received Hello, mirrored world!"


def publisher(port: int, import_line: str = "import pika") -> str:
    return _PUBLISHER.format(import_line=import_line, port=port)


def consumer(port: int, import_line: str = "import pika") -> str:
    return _CONSUMER.format(import_line=import_line, port=port)
