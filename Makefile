# other targets live above

# --- Docker cluster: docker/, docker-compose.yml ------------------------------
# docker-engine  installs docker.io, docker-compose and debootstrap if missing
#                and starts dockerd as root in the background (pid in
#                /run/warren-dockerd.pid, log in /tmp/warren-dockerd.log)
# docker-image   builds warren-base:bookworm (once) and warren:latest
# docker-up      docker-image, then a three-node cluster n1..n3
# docker-down    stops and removes that cluster
DOCKER_COMPOSE ?= docker-compose

.PHONY: docker-engine docker-image docker-up docker-down

docker-engine:
	sh docker/engine.sh

docker-image:
	bash docker/build-image.sh

docker-up: docker-image
	$(DOCKER_COMPOSE) up -d

docker-down:
	$(DOCKER_COMPOSE) down --remove-orphans
