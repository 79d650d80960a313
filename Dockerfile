# The specq image: workers, beat, migrations and Flower all run from it.
#   docker build --build-arg TORCH=cu128 -t specq .     # CUDA 12.8 torch (GPU workers)
#   docker build --build-arg TORCH=cpu -t specq .       # CPU torch (beat, Flower, tests)
FROM python:3.11-slim
ARG TORCH=cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# torch first, from the index of the chosen build (an open torch requirement would pull CUDA).
RUN pip install torch --index-url "https://download.pytorch.org/whl/${TORCH}"
COPY pyproject.toml README.md alembic.ini ./
COPY api api
COPY configs configs
COPY db db
COPY worker worker
RUN pip install ".[flower]"
# alembic.ini (script_location db/migrations) and the sources stay in /app, the working dir.
CMD ["specq", "--help"]
