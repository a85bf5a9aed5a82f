"""An OpenAI-compatible HTTP server on the in-flight engine: `transformers-flexcache serve PATH`.

- `app.py`: `create_app(...)`: the FastAPI application, its small routes (`/health`, `/metrics`, `/v1/models`), the
  error bodies, and what the routes share (`ServedModel`);
- `completions.py`: `POST /v1/completions`: OpenAI's parameters as `generate` arguments, answers and SSE streams;
- `decoding.py`: how a completion's tokens are chosen (greedy, sampling, beam search) from OpenAI's and vLLM's fields;
- `logprobs.py`: the log probabilities of a completion's tokens, as OpenAI's `logprobs` object;
- `scoring.py`: the score of given tokens (`echo` with `logprobs`), by forced decoding on the engine;
- `transcriptions.py`: `POST /v1/audio/transcriptions` and `/v1/audio/translations`: a recording of any length
  through the checkpoint's processor to Whisper's (long-form) generate, one engine request;
- `transcript.py`: what Whisper's generate returns as OpenAI's answers (json, text, verbose_json, srt, vtt);
- `audio.py`: audio files decoded and resampled by FFmpeg's libraries (PyAV);
- `text.py`: a sequence's completion text (stop sequences, finish reason) and its pieces for a stream;
- `bridge.py`: a request handle's steps, delivered to the event loop;
- `schemas.py`: OpenAI's request bodies, answers and error body;
- `metrics.py`: Prometheus metrics;
- `cli.py`: the `serve` command (the checkpoint, the engine, uvicorn, SIGTERM).

The server knows nothing of the model's internals: it tokenizes, submits requests to the engine and decodes what
they return. The engine knows nothing of HTTP. Importing this package imports neither FastAPI nor a model.
"""
