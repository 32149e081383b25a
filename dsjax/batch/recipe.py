"""Requests in and responses out through `deepseek-recipe`: conversion, prompt encoding, sampling
options, and the stream processor that turns generated tokens into the protocol's response.

Nothing here writes chat templates or parses model output by hand: the recipe does both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
import uuid
from typing import Any, Sequence

import deepseek_recipe as dr

from dsjax.batch import formats, tool_calls
from dsjax.batch.bodies import complete_body
from dsjax.batch.images import ImageRefused, ImageResolver, LocalImageError, count_images, inline_local_images
from dsjax.batch.jobfile import ErrorInfo, InputLine, clip
from dsjax.batch.options import unenforced_constraint, unsupported_option
from dsjax.config import ModelConfig, VisionConfig
from dsjax.config_v41 import V41VisionConfig
from dsjax.engine.grammar import Constraint, GrammarError, Grammars
from dsjax.engine.sampling import MAX_LOGPROBS, SamplingParams

_ENDPOINTS = {
    "/v1/chat/completions": (dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-"),
    "/v1/responses": (dr.ResponsesRequest, dr.ResponsesResponse, "resp_"),
    "/v1/messages": (dr.MessagesRequest, dr.MessagesResponse, "msg_"),
}


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: its preprocessed bytes (the recipe's), filling `length` prompt positions
    from `start` (its placeholder, expanded to the image's token count)."""

    start: int
    length: int
    data: bytes


@dataclasses.dataclass
class Prepared:
    """A request ready for the engine: its prompt, sampling, and a factory for its response stream."""

    line: InputLine
    prompt: list[int]
    sampling: SamplingParams
    _conversation: Any
    _generator_factory: Any
    _response_cls: Any
    _model: str
    _response_id: str
    images: tuple[ImageSpan, ...] = ()
    constraint: Constraint | None = None  # the output format it asks for, enforced by constrained decoding
    thinking_budget: int | None = None  # the most tokens its thinking part may take (engine.thinking_budget)


class ResponseStream:
    """Feeds one request's tokens to its stream processor and accumulates the protocol response."""

    def __init__(self, prep: Prepared, tokenizer: dr.Tokenizer):
        self._url = prep.line.url
        self._processor = dr.StreamProcessor(prep._generator_factory(), prep._conversation.parsing_options,
                                             tokenizer)
        self._response = prep._response_cls(prep._response_id, prep._model, int(time.time()), len(prep.prompt), 0)
        self._push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=len(prep.prompt))))

    def _push(self, chunk) -> None:
        for out in self._processor.push(chunk):
            self._response.accumulate(out)

    def token(self, token: int, logprob: float, top) -> bool:
        """Push one generated token; True when the processor has ended the response (a stop sequence)."""
        logprobs = None if top is None else [(logprob, list(top))]
        self._push(dr.InferenceChunk.tokens([token], logprobs))
        return self._processor.finished

    def finish(self, reason: str) -> dict[str, Any]:
        """The final response body; `reason` is the engine's ("stop" or "length")."""
        if not self._processor.finished:
            fr = dr.InferenceFinishReason.Stop if reason == "stop" else dr.InferenceFinishReason.Length
            self._push(dr.InferenceChunk.finish(fr))
        for out in self._processor.finish():
            self._response.accumulate(out)
        return complete_body(self._url, json.loads(self._response.to_json()))


# The prompt formats deepseek-recipe renders, and the name it knows each model version by.
PROMPT_FORMATS = {"v4": dr.ModelVersion.DeepseekV4Pro, "v4.1": dr.ModelVersion.DeepseekV41Flash}
RECIPE_NAMES = {"v4": "DeepSeek-V4-Pro", "v4.1": "DeepSeek-V4.1-Flash"}


def prompt_format(cfg: ModelConfig) -> str:
    """The prompt format a checkpoint was trained on: V4.1's for DeepSeek-V4.1 and for a model that reads
    images (V4's encoding renders no images), else V4's."""
    if getattr(cfg, "family", "v4") == "v4.1":
        return "v4.1"
    return _format_for(cfg.vision)


def _format_for(vision: VisionConfig | V41VisionConfig | None) -> str:
    return "v4.1" if vision is not None else "v4"


def default_served_names(model_dir: str, fmt: str) -> tuple[str, ...]:
    """The names a job answers to by default: the checkpoint folder's name and the recipe's name for its
    model version."""
    folder = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    return tuple(dict.fromkeys([folder, RECIPE_NAMES[fmt]]))


class Recipe:
    """Converts batch lines with the recipe; `context_limit` bounds prompt + max_tokens.

    Prompts are encoded in the checkpoint's `prompt_format` ("v4" or "v4.1"; by default V4.1's with
    `vision`, else V4's), whatever a request's model name; a request must name one of `served_names`
    (responses carry the name it used). With `vision` (the model's image encoder config) requests may
    hold images: `images` resolves them (remote URLs refused unless it allows them), local image files
    are read from `image_root`, and each image's placeholder is expanded to the encoder's token count
    for it (`Prepared.images`). An output format (`batch.formats`), strict tools or a required tool call
    (`batch.tool_calls`) become the request's `Prepared.constraint`, its grammar compiled here (`grammars`, for the model's `vocab_size` logits; an invalid one is the request's
    error); with `no_formats` (the reason) such requests are refused instead. A response that starts in a thinking
    part gets `thinking_budget` (or its Messages request's `thinking.budget_tokens`) as its
    `Prepared.thinking_budget`. Raises ValueError
    naming the file when the tokenizer cannot be read or cannot encode the prompt format."""

    def __init__(self, tokenizer_path: str, context_limit: int, eos_token_ids: tuple[int, ...],
                 prompt_format: str | None = None, served_names: Sequence[str] = (),
                 vision: VisionConfig | V41VisionConfig | None = None, images: ImageResolver | None = None, image_root: str = ".",
                 vocab_size: int | None = None, no_formats: str | None = None, thinking_budget: int | None = None):
        if prompt_format is None:
            prompt_format = _format_for(vision)
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {sorted(PROMPT_FORMATS)}, got {prompt_format!r}")
        try:
            self.tokenizer = dr.Tokenizer.from_file(tokenizer_path)
        except (OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{tokenizer_path}: not a tokenizer file that can be read ({_clip(e)})") from None
        self.context_limit = context_limit
        self.eos_token_ids = tuple(eos_token_ids)
        self.prompt_format = prompt_format
        self.served_names = tuple(served_names) or (RECIPE_NAMES[prompt_format],)
        version = PROMPT_FORMATS[prompt_format]
        self.options = dr.ConversionOptions().with_model_versions_by_name({n: version for n in self.served_names})
        self.vision, self.images, self.image_root = vision, images or ImageResolver(), image_root
        self._tokenizer_path, self._vocab_size, self.no_formats = tokenizer_path, vocab_size, no_formats
        self.thinking_budget = thinking_budget
        self._grammars: Grammars | None = None  # made at the first request with a format
        self._grammars_lock = threading.Lock()
        ends = self.tokenizer.encode(dr.SpecialToken.ThinkingEnd.default_str())
        self.thinking_end_id = ends[0] if len(ends) == 1 else None
        self.image_token_id = None
        if vision is not None:
            spelling = dr.SpecialToken.Image.default_str()
            ids = self.tokenizer.encode(spelling)
            if len(ids) != 1:
                raise ValueError(f"{tokenizer_path} has no {spelling} token (it encodes as {ids}): a model that "
                                 "reads images needs it as one token")
            self.image_token_id = ids[0]
        encoding = dr.DeepseekV4Encoding() if prompt_format == "v4" else dr.DeepseekV41Encoding()
        self._encoding = encoding.with_tokenizer(self.tokenizer)
        # Every prompt of this format renders these blocks: a tokenizer without their special tokens
        # would fail every request, so it fails the job before any work instead.
        probe = dr.ChatCompletionRequest({"model": self.served_names[0], "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}).convert(self.options)
        try:
            self._encoding.encode(probe.conversation)
        except (ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"{tokenizer_path} cannot encode {RECIPE_NAMES[prompt_format]}'s prompt format "
                             f"({_clip(e)}): the checkpoint's tokenizer must hold its special tokens") from None

    def prepare(self, line: InputLine) -> Prepared | ErrorInfo:
        """The request of `line` ready for the engine, or the error record's reason it cannot run."""
        try:
            return self._prepare(line)
        except (OverflowError, ValueError, TypeError, KeyError, UnicodeError, RecursionError) as e:
            # Whatever else in a body the recipe cannot take (an integer past 2^64, text that is not
            # valid Unicode) is that request's error, never the job's.
            return ErrorInfo("invalid_request", f"the request body was rejected: {_clip(e)}")

    def _prepare(self, line: InputLine) -> Prepared | ErrorInfo:
        request_cls, response_cls, id_prefix = _ENDPOINTS[line.url]
        model = line.body.get("model")
        if model is None:
            return ErrorInfo("invalid_request", "the request body has no 'model': name one of the served models "
                                                f"{list(self.served_names)}")
        if not isinstance(model, str) or model not in self.served_names:
            return ErrorInfo("model_not_found", f"the model {_clip(repr(model))} is not served by this job; it "
                                                f"serves {list(self.served_names)} (set with --served-model-name)")
        if (bad := unsupported_option(line.url, line.body)) is not None:
            return bad
        reads_images = self.vision is not None and self.prompt_format == "v4.1"
        if not reads_images and (n := count_images(line.body)):
            # The prompt would hold the image placeholders (V4's: "[Unsupported Image]") without the
            # images: answering it would silently ignore them.
            return ErrorInfo("image_input_unsupported",
                             f"the request holds {n} image(s); this model reads no images (its config has no "
                             "vision_config): send text only")
        try:
            body, own_format = formats.split(line.url, line.body)
        except formats.FormatError as e:
            return ErrorInfo("invalid_request", f"the request's output format is wrong: {e}")
        try:
            body = inline_local_images(body, self.image_root, self.images.max_bytes)
        except LocalImageError as e:
            return ErrorInfo("invalid_image", str(e))
        try:
            request = request_cls(body)
            extras = {}
            if request_cls is dr.ResponsesRequest:
                extras = {"tools": request.namespace_tool_map(self.options), "echo": request.echo()}
            conversation = request.convert(self.options)
        except (dr.ConversionError, ValueError, TypeError, KeyError) as e:
            return ErrorInfo("invalid_request", f"the request body was rejected: {_clip(e)}")
        found = conversation.inference_options.output_constraint
        if (bad := unenforced_constraint(found.kind if found is not None else None)) is not None:
            return bad
        if found is not None and found.kind.startswith("tool_call"):
            if found.kind == "tool_call" and not tool_calls.strict_tools(found.schema):
                found = None  # optional calls of tools that are not strict: nothing to hold them to
            elif own_format is not None:
                return ErrorInfo("unsupported_parameter", "the request asks for an output format and for strict "
                                                          "tools or a required tool call: dsjax enforces one or "
                                                          "the other; drop one")
        constraint = self._constraint(own_format or (
            formats.recipe_constraint(found.kind, found.schema) if found is not None else None),
            conversation.parsing_options)
        if isinstance(constraint, ErrorInfo):
            return constraint
        sources = [s for m in conversation.conversation.messages for s in m.image_sources]
        try:
            prompt = self._encoding.encode(conversation.conversation)
        except (ValueError, RuntimeError, KeyError) as e:
            return ErrorInfo("encoding_failed", f"the prompt could not be encoded with this model's tokenizer: {_clip(e)}")
        images: tuple[ImageSpan, ...] = ()
        if sources:
            expanded = self._expand_images(list(prompt), sources)
            if isinstance(expanded, ErrorInfo):
                return expanded
            prompt, images = expanded
        try:
            max_tokens = conversation.resolve_max_tokens(len(prompt), self.context_limit)
        except dr.ConversionError as e:
            return ErrorInfo("context_length_exceeded", f"{_clip(e)} (prompt: {len(prompt)} tokens, context limit: "
                                                         f"{self.context_limit})")
        opts = conversation.inference_options
        n_logprobs = None
        if opts.logprobs:
            n_logprobs = min(opts.top_logprobs or 0, MAX_LOGPROBS)
        try:
            sampling = SamplingParams(temperature=opts.temperature if opts.temperature is not None else 1.0,
                                      top_p=opts.top_p if opts.top_p is not None else 1.0, seed=opts.seed,
                                      stop_token_ids=self.eos_token_ids, max_tokens=max_tokens,
                                      logprobs=n_logprobs)
        except ValueError as e:
            return ErrorInfo("invalid_request", f"unsupported sampling options: {_clip(e)}")
        budget = self._thinking_budget(line, conversation.parsing_options, max_tokens)
        if isinstance(budget, ErrorInfo):
            return budget
        response_id = id_prefix + uuid.uuid4().hex

        def generator():
            gen = request_cls.chunk_generator(conversation, response_id, model)
            if extras:
                gen = gen.with_namespace_tool_map(extras["tools"]).with_echo(extras["echo"])
            return gen

        return Prepared(line, list(prompt), sampling, conversation, generator, response_cls, model, response_id,
                        images, constraint, budget)

    def _thinking_budget(self, line: InputLine, parsing, max_tokens: int) -> int | None | ErrorInfo:
        """The request's thinking budget (Messages' `thinking.budget_tokens`, else the job's), where its response
        starts in a thinking part and the budget is below its `max_tokens`; else None."""
        thinking = line.body.get("thinking") if line.url == "/v1/messages" else None
        asked = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 0):
            return ErrorInfo("invalid_request", f"thinking.budget_tokens must be an integer >= 0, got {asked!r}")
        budget = asked if asked is not None else self.thinking_budget
        stage = parsing.thinking_initial_stage
        if budget is None or budget >= max_tokens or stage is None or not stage.starts_in_reasoning():
            return None
        if self.thinking_end_id is None:
            return ErrorInfo("unsupported_parameter", "a thinking budget needs the tokenizer's end-of-thinking "
                                                      "token, which it lacks")
        if self.no_formats is not None:
            return ErrorInfo("unsupported_parameter", f"the request has a thinking budget: {self.no_formats}")
        return budget

    @property
    def grammars(self) -> Grammars:
        """The grammars of the requests' output formats, compiled once each for this tokenizer (made at first use)."""
        with self._grammars_lock:
            if self._grammars is None:
                with open(self._tokenizer_path, encoding="utf-8") as f:
                    text = f.read()
                self._grammars = Grammars(text, self._vocab_size, self.eos_token_ids)
            return self._grammars

    def _constraint(self, spec: tuple[str, str] | None, parsing) -> Constraint | ErrorInfo | None:
        """The request's `Constraint` from its format's kind and text, compiled (an invalid one is its error); it
        starts after the thinking part where the response begins in one."""
        if spec is None:
            return None
        if self.no_formats is not None:
            what = "strict tools or a required tool call" if spec[0] == "tool_calls" else "an output format"
            return ErrorInfo("unsupported_parameter", f"the request asks for {what}: {self.no_formats}")
        if spec[0] == "tool_calls":
            return self._tool_constraint(spec[1], parsing)
        after = None
        stage = parsing.thinking_initial_stage
        if stage is not None and stage.starts_in_reasoning():
            if self.thinking_end_id is None:
                return ErrorInfo("unsupported_parameter", "an output format after the thinking part needs the "
                                                          "tokenizer's end-of-thinking token, which it lacks")
            after = self.thinking_end_id
        return self._compiled(Constraint(*spec, after=after), "invalid_response_format", "the output format")

    def _tool_constraint(self, tools_json: str, parsing) -> Constraint | ErrorInfo:
        """The grammar of the tool-call block: from its first invoke where the prompt opened the block (a
        required call), else from the block's first `｜DSML｜` token, which the output need not reach."""
        ids = self.tokenizer.encode(dr.SpecialToken.Dsml.default_str())
        if len(ids) != 1:
            return ErrorInfo("unsupported_parameter", "strict tools and required tool calls need the tokenizer's "
                                                      f"{dr.SpecialToken.Dsml.default_str()} token, which it lacks")
        opened = parsing.starts_in_tool_calls
        try:
            grammar = tool_calls.tool_call_grammar(tools_json, ids[0], opened, self.prompt_format)
        except ValueError as e:
            return ErrorInfo("invalid_request", f"the request's tools cannot be enforced: {_clip(e)}")
        constraint = Constraint("lark", grammar, after=None if opened else ids[0], optional=not opened)
        compiled = self._compiled(constraint, "invalid_tool_schema", "the tools' parameter schemas")
        if isinstance(compiled, ErrorInfo):  # name the parameter: llguidance's message quotes grammar lines
            for tool, name, value in tool_calls.parameter_grammars(tools_json):
                try:
                    self.grammars.check(Constraint("lark", value))
                except GrammarError as e:
                    why = re.sub(r"^at \d+\(\d+\): ", "", " ".join(str(e).split()))
                    return ErrorInfo("invalid_tool_schema", f"tool {tool!r}: parameter {name!r} cannot be enforced: "
                                                            f"{_clip(why)}")
        return compiled

    def _compiled(self, constraint: Constraint, code: str, what: str) -> Constraint | ErrorInfo:
        """`constraint`, its grammar compiled into the cache, or the error naming what is wrong with it."""
        try:
            self.grammars.check(constraint)
        except GrammarError as e:
            return ErrorInfo(code, f"{what} cannot be enforced: {_clip(e)}")
        return constraint

    def _expand_images(self, prompt: list[int], sources) -> tuple[list[int], tuple[ImageSpan, ...]] | ErrorInfo:
        """Resolve the request's images and repeat each placeholder token as many times as the image has
        tokens (the placeholders keep their id, which the hash-routed layers route by)."""
        try:
            data = self.images.resolve(sources)
            adjustment = data.image_token_adjustment()
        except ImageRefused as e:
            return ErrorInfo("image_refused", str(e))
        except (dr.ImageError, dr.CalcResizeError) as e:
            return ErrorInfo("invalid_image", f"an image of the request could not be used: {_clip(e)}")
        at = [i for i, t in enumerate(prompt) if t == self.image_token_id]
        infos = data.images
        if len(at) != len(infos):
            return ErrorInfo("invalid_request", f"the prompt holds {len(at)} image placeholder(s) for {len(infos)} "
                                                "image(s)")
        counts = [self.vision.image_tokens(i.width, i.height) for i in infos]
        if sum(counts) - len(counts) != adjustment:
            raise RuntimeError(f"the encoder's image token counts {counts} disagree with the recipe's "
                               f"(+{adjustment} over the placeholders): deepseek-recipe changed its image rule")
        out, spans, last = [], [], 0
        for pos, n, info in zip(at, counts, infos):
            out += prompt[last:pos]
            spans.append(ImageSpan(len(out), n, info.data))
            out += [self.image_token_id] * n
            last = pos + 1
        return out + prompt[last:], tuple(spans)

    def stream(self, prep: Prepared) -> ResponseStream:
        return ResponseStream(prep, self.tokenizer)


def _clip(e: BaseException | str) -> str:
    return clip(str(e))
