# tokenmill: one image for the broker and the GPU workers (docker-compose.yml runs both).
# Configuration is by environment variables (TOKENMILL_*), one per setting (README.md, "Configuration").
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# torch first, in its own layer: the default index's Linux wheel carries CUDA for the GPU workers.
RUN pip install "torch>=2.4"

COPY pyproject.toml README.md ./
COPY broker ./broker
COPY worker ./worker
COPY kernels ./kernels
COPY client ./client
COPY cli ./cli
COPY benchmarks ./benchmarks
RUN pip install ".[gpu]"

# Run as an unprivileged user; CURVE key files mounted into /keys must be readable by it (mode 0600).
RUN useradd --create-home --uid 1000 tokenmill
USER tokenmill

EXPOSE 5555 5556
ENTRYPOINT []
CMD ["tokenmill", "up"]
