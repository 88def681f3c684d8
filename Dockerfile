# The Coordinator's image: the deployer's default `image_name` (motor-coordinator:latest).
#
#     docker build -t motor-coordinator:latest .
#
# The official python images build CPython with PGO and LTO (--enable-optimizations --with-lto). The
# Coordinator's CPU per request was 7-22 % lower on such a build than on one without them, on the same
# code and machine (docs/performance.md, "The interpreter"). Pin the base by digest in production:
#     docker build --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:... .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

WORKDIR /opt/motor
COPY requirements.txt ./
# tokenizers: exact prompt counts for models with a tokenizer_path (optional; the pin of requirements-test.txt).
RUN pip install --no-cache-dir -r requirements.txt tokenizers==0.23.3

# What `python app.py` imports, and its default config (the built-in engine simulator serves when that
# config lists no instances; rendered deployments mount theirs and pass --config).
COPY app.py ./
COPY config/ config/
COPY errors/ errors/
COPY engines/ engines/
COPY state/ state/
COPY scheduling/ scheduling/
COPY serving/ serving/
COPY handlers/ handlers/
COPY workers/ workers/
COPY engine_sim/ engine_sim/
COPY deployer/user_config.json deployer/
# The pods' root filesystem is read-only: compile the bytecode now rather than at every start.
RUN python -m compileall -q .

# The deployer's default run_as_user; the pod's securityContext sets the same.
USER 1000:1000
EXPOSE 1025 1026 1027
CMD ["python", "app.py"]
