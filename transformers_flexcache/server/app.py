"""The FastAPI application: `create_app(engine, tokenizer=..., model_name=...)`.

Design decisions:
- One model per server, under `model_name` (the checkpoint's path by default, as vLLM names it): a request naming
  another model gets OpenAI's 404 `model_not_found`; one naming none gets this one.
- Which route answers follows what the model takes (`model.main_input_name`): token ids -> `/v1/completions`;
  audio features, with the checkpoint's processor -> `/v1/audio/transcriptions` and `/v1/audio/translations`. The
  others answer 400, saying so.
- Every error is OpenAI's error body. FastAPI's validation errors (its 422 `detail` list) become 400s naming the
  field, as OpenAI's API and vLLM answer them.
- `Engine.submit`'s refusals map to HTTP: `CapacityError` -> 400 naming the server flag that fits (`hints` say which
  request field to change instead); any other `ValueError` -> 400; `QueueFullError` -> 429 with `Retry-After`;
  `EngineClosedError` -> 503. A request that fails in its `generate` -> 500 (400 for the `ValueError`/`TypeError`
  with which `generate` refuses arguments), and the engine serves the others on.
- Shutdown: `ServedModel.draining` (set on SIGTERM by the command) answers new requests 503 while running ones
  finish; the application's lifespan ends by closing the engine with `drain=True`.
- A compiled engine warms up after the port opens (`warmup.py`): `/health` answers 503 `"warming"` with the graphs
  done and in all, requests 503 `warming_up` with `Retry-After`, until it is done.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ..log import get_logger
from ..serving import CapacityError, EngineClosedError, QueueFullError, RequestCancelledError
from . import bridge
from .metrics import ServerMetrics
from .schemas import APIError, model_card

logger = get_logger(__name__)

# The server flag that sets each engine capacity.
CAPACITY_FLAGS = {
    "max_batch_size": "--max-batch-size",
    "max_cache_len": "--max-cache-len",
    "max_encoder_len": "--max-encoder-len",
}
# The routes' own labels in the metrics; any other path is "other".
ROUTES = {"/v1/completions", "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/models", "/health", "/metrics"}
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there


class ServedModel:
    """What the routes share: the engine, the checkpoint's tokenizer (and processor), the served name, metrics.

    Args:
        engine (`Engine`): the in-flight engine; the application closes it when it shuts down.
        tokenizer: the checkpoint's tokenizer.
        processor (*optional*): the checkpoint's processor, for a model that takes audio.
        model_name (`str`): the name requests give as `model`.
    """

    def __init__(self, engine, *, tokenizer, processor=None, model_name: str, warmup=None):
        self.engine = engine
        self.warmup = warmup  # `server.warmup.Warmup`, or None for an engine that needs none
        self.tokenizer = tokenizer
        self.processor = processor
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine)
        self.draining = False
        model = engine.model
        self.model_class = type(model).__name__
        self.is_encoder_decoder = engine.is_encoder_decoder
        self.takes_text = model.main_input_name == "input_ids"
        self.takes_audio = model.main_input_name == "input_features" and hasattr(processor, "feature_extractor")
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        eos = model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_token_id = model.generation_config.pad_token_id
        start = model.generation_config.decoder_start_token_id
        self.decoder_start_token_id = (
            start if start is not None else getattr(model.config, "decoder_start_token_id", None)
        )

    # --- checks every route makes -----------------------------------------------------------------------------
    def check_request(self, model: str | None, *, route: str, needs: str) -> None:
        """Refuse a request to a draining or warming server, for another model, or of a kind this model does not
        take."""
        if self.draining:
            raise APIError(
                503, "the server is shutting down: it takes no new requests", type="server_error", code="shutting_down"
            )
        if self.warmup is not None and not self.warmup.ready:
            raise self.not_warm()
        if model is not None and model != self.model_name:
            raise self.model_not_found(model)
        takes = {"text": self.takes_text, "audio": self.takes_audio}
        if not takes[needs]:
            other = "/v1/audio/transcriptions" if self.takes_audio else "/v1/completions"
            raise APIError(
                400,
                f"{self.model_name} ({self.model_class}) does not take {needs}: {route} is not served; send "
                f"requests to {other}",
            )

    def not_warm(self) -> APIError:
        """503 while the graphs compile (`Retry-After`: the graphs left at the pace so far), or after a failed
        warm-up."""
        warmup = self.warmup
        if warmup.state == "failed":
            return APIError(
                503, f"the server's warm-up failed ({warmup.body()['error']}): it cannot serve", type="server_error"
            )
        seconds = warmup.retry_after()
        total = "?" if warmup.total is None else warmup.total
        return APIError(
            503,
            f"the server is compiling its graphs ({warmup.done} of {total} done, {warmup.elapsed:.0f} s so far): "
            f"retry after {seconds} s (GET /health says when it is ready)",
            type="server_error",
            code="warming_up",
            headers={"Retry-After": str(seconds)},
        )

    def model_not_found(self, model: str) -> APIError:
        return APIError(
            404,
            f"the model {model!r} does not exist: this server serves {self.model_name!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    # --- the engine -------------------------------------------------------------------------------------------
    def submit(self, *, seed: int | None, hints: dict[str, tuple[str, str]], **kwargs):
        """`engine.submit(seed=seed, **kwargs)`, its refusals as `APIError`s. `hints` maps a capacity to the request
        field that needs it and what the client can change instead of the server's flag."""
        try:
            return self.engine.submit(seed=seed, **kwargs)
        except CapacityError as error:
            raise capacity_error(error, hints) from error
        except QueueFullError as error:
            seconds = max(1, math.ceil(error.retry_after))
            raise APIError(
                429,
                f"{self.engine.num_queued} requests are already waiting for seats (the server's --max-queue is "
                f"{self.engine.max_queue}): retry after {seconds} s, or start the server with a larger --max-queue "
                "or --max-batch-size",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(seconds)},
            ) from error
        except EngineClosedError as error:
            raise APIError(
                503, "the server is shutting down: it takes no new requests", type="server_error", code="shutting_down"
            ) from error
        except (ValueError, TypeError) as error:
            raise APIError(400, f"the request cannot be served: {error}") from error

    def failure(self, error: BaseException) -> APIError:
        """The answer to a request that ended with `error` in the engine."""
        if isinstance(error, EngineClosedError):
            return APIError(503, f"the server shut down before the request finished: {error}", type="server_error")
        if isinstance(error, RequestCancelledError):
            return APIError(499, "the request was cancelled", type="server_error")
        if isinstance(error, (ValueError, TypeError)):  # generate's refusal of its arguments
            return APIError(400, f"generate refused the request: {error}")
        logger.error("a request failed in the model", exc_info=error)
        return APIError(
            500,
            f"the model failed on this request ({type(error).__name__}: {error}); the server serves others on",
            type="server_error",
        )

    async def wait(self, handles: list, request: Request) -> bool:
        """Wait until every handle is done. Returns False when the client disconnected first; raises the first
        failure as an `APIError`. Either way no handle is left running."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        for key, handle in enumerate(handles):
            bridge.follow(handle, key, queue, loop, steps=False)
        remaining = set(range(len(handles)))
        try:
            while remaining:
                try:
                    key, _ = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)  # only ends
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return False
                    continue
                remaining.discard(key)
                error = handles[key].exception(timeout=0)
                if error is not None:
                    raise self.failure(error)
            return True
        finally:
            for handle in handles:
                handle.cancel()  # a no-op for a finished one


def capacity_error(error: CapacityError, hints: dict[str, tuple[str, str]]) -> APIError:
    """A 400 for a request that can never fit: the value, the limit and the server flag that fits."""
    parts, param = [], None
    for name, needed in error.needed.items():
        field, instead = hints.get(name, (None, ""))
        param = param or field
        parts.append(
            f"this request needs {name}={needed} but the server has {name}={error.limits[name]}: start the server "
            f"with {CAPACITY_FLAGS[name]} {needed} or more{', or ' + instead if instead else ''}"
        )
    lengths = {"max_cache_len", "max_encoder_len"} & set(error.needed)
    return APIError(400, "; ".join(parts), param=param, code="context_length_exceeded" if lengths else None)


def create_app(engine, *, tokenizer, processor=None, model_name: str, warmup=None) -> FastAPI:
    """The OpenAI-compatible application on `engine` (see the module docstring); it closes the engine, draining
    it, when it shuts down. With `warmup` (`server.warmup.Warmup`) it starts the engine's warm-up once the port is
    open, answers `/health` with its progress and refuses requests (503) until it is done."""
    from .completions import router as completions_router
    from .transcriptions import router as transcriptions_router

    served = ServedModel(engine, tokenizer=tokenizer, processor=processor, model_name=model_name, warmup=warmup)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if warmup is not None:
            warmup.start()
        yield
        served.draining = True
        await asyncio.to_thread(engine.close, drain=True)

    app = FastAPI(title="transformers-flexcache", lifespan=lifespan)
    app.state.served = served
    app.include_router(completions_router)
    app.include_router(transcriptions_router)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        # Unknown paths share one label: a scan of random paths must not grow the metrics.
        route = request.url.path if request.url.path in ROUTES else "other"
        served.metrics.refused(route, error.status_code)
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        problems, param = [], None
        for problem in error.errors():
            where = ".".join(str(part) for part in problem["loc"] if part not in ("body", "query", "form"))
            param = param or where or None
            problems.append(f"{where}: {problem['msg']}" if where else problem["msg"])
        return await api_error(request, APIError(400, "invalid request: " + "; ".join(problems), param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return await api_error(request, APIError(error.status_code, f"{request.url.path}: {error.detail}", code=code))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.error("an error of the server itself", exc_info=error)
        failure = APIError(500, f"the server failed ({type(error).__name__}: {error})", type="server_error")
        return await api_error(request, failure)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "draining" if served.draining else "ok"
        if warmup is not None and not warmup.ready and not served.draining:
            status = "warming" if warmup.state in ("pending", "warming") else "failed"
        body = {
            "status": status,
            "model": served.model_name,
            "seats_in_use": engine.seats_in_use,
            "max_batch_size": engine.max_batch_size,
            "running": engine.num_running,
            "queued": engine.num_queued,
        }
        if warmup is not None:
            body["warmup"] = warmup.body()
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=served.metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(served.model_name, served.created)]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        if model != served.model_name:
            raise served.model_not_found(model)
        return model_card(served.model_name, served.created)

    return app
