# The specq image: workers, beat, migrations, the HTTP API and Flower all run from it, as the unprivileged
# user specq (uid 10001), never as root.
#   docker build --build-arg TORCH=cu128 -t specq .     # CUDA 12.8 torch (GPU workers)
#   docker build --build-arg TORCH=cpu -t specq .       # CPU torch (beat, Flower, tests)
FROM python:3.11-slim
ARG TORCH=cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The image's data directory (specq's default is the user's, ~/.local/share/specq): the
# volume mounted at /app/data keeps tiny models, converted checkpoints, beat state, data sets.
ENV SPECQ_DATA_DIR=/app/data
WORKDIR /app
# The user owns its home (torch caches), the data directory (tiny models, beat state,
# synthesis data sets) and /app/models (the workers' Hugging Face cache, HF_HOME in
# compose); a new named volume mounted on either copies this ownership. Nothing else: the
# code and site-packages stay root's, read-only to the services.
RUN groupadd --gid 10001 specq \
 && useradd --uid 10001 --gid specq --create-home --home-dir /home/specq \
      --shell /usr/sbin/nologin specq \
 && install -d -o specq -g specq -m 0750 /app/data /app/models
# torch first, from the index of the chosen build (an open torch requirement would pull CUDA).
RUN pip install torch --index-url "https://download.pytorch.org/whl/${TORCH}"
COPY pyproject.toml README.md alembic.ini ./
COPY api api
COPY broker broker
COPY worker worker
COPY db db
COPY configs configs
COPY schema schema
COPY bench bench
COPY src src
RUN pip install ".[worker,flower,serve]"
# alembic.ini (script_location db/migrations) and the sources stay in /app, the working dir.
# Numeric, so that a runtime that refuses root (Kubernetes runAsNonRoot) can check it.
USER 10001:10001
CMD ["specq", "--help"]
