"""Randomized differential test of PD serving against the colocated engine, over real processes.

A seeded generator of OpenAI requests (completions and chat; greedy and seeded sampling, top_p / top_k, n, logprobs,
echo, stop strings and stop ids, min_tokens, max_tokens down to 1, penalties, logit_bias, structured output, tool
calls, streaming) with prompt lengths around attention-block boundaries, very short prompts, prompts near
max_model_len and shared prefixes (prefix-cache hits on P and on D). Each request goes, in the same order, to a 1P1D
cluster and to a colocated cluster of the same model; the two answers must agree: text, token ids, logprobs (within
1e-4), finish reasons, usage counts, and for streams the deltas put together.

    python -m benchmarks.pd_differential --requests 300 --seed 1 --family nemotron_h
    python -m benchmarks.pd_differential --requests 120 --family qwen3_5_moe --prefill-args "--tensor-parallel-size 2"

`--family` picks a tiny random model (FAMILIES: hybrids, the Qwen3.5 MoE, models without attention layers);
`--prefill-args` / `--decode-args` give the PD cluster's workers of one role more flags (PD between different tensor
parallel sizes; the colocated reference keeps `--worker-args` only).

prints one line per difference (and the request that gave it) and a summary; exits 1 when any differ.
`tests/unit/test_pd_differential.py` runs a fixed sample in CI.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema

BLOCK = 16
MAX_MODEL_LEN = 256
VOCAB = 256  # byte tokens of the built-in tokenizer: any id below is an ordinary token
TOL = 1e-4
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron_h": ("nemotron_h", {"hybrid_override_pattern": "M*-MM-"}),
    "qwen3_5": (
        "qwen3_5",
        {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    ),
    "qwen3_5_moe": (
        "qwen3_5_moe",
        {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    ),
    "nemotron_h_no_attn": ("nemotron_h", {"hybrid_override_pattern": "M-M"}),
    "qwen3_5_no_attn": ("qwen3_5", {"layer_types": ["linear_attention", "linear_attention"]}),
}
"""Name -> (checkpoint family, config overrides); the `_no_attn` ones have no attention layer at all."""
WORDS = (
    "alpha beta gamma delta the quick brown fox jumps over lazy dog json data give me some numbers "
    "please write hello world ok"
).split()
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"type": "string", "maxLength": 4}},
    "required": ["n", "s"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 4},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    }
]
IGNORED_KEYS = {"id", "created", "system_fingerprint", "prompt_tokens_details", "hybridpd", "model"}
"""Fields that may differ legitimately: ids, clocks, and where in the cluster a prompt was found cached."""


@dataclass
class Case:
    index: int
    endpoint: str  # "completions" | "chat/completions"
    body: dict[str, Any]
    stop_from_output: tuple[str, int, int] | None = None
    """(kind "text" | "id", position, length): before sending, run the request without stops on the colocated
    cluster and stop at what its output has there (a stop string of `length` characters at character `position`,
    or the token id at `position`), so that stops really trigger, at P's first token (position 0) or later."""
    abandon: bool = False
    """A stream the client hangs up on after its first chunk (not compared; what follows must still agree)."""
    continues: bool = False
    """The prompt is put after an earlier completion's prompt and output (token ids): D holds that output's blocks
    in its prefix cache, P never saw them."""


class RequestGen:
    """Seeded OpenAI request bodies. Prompt ids come from a small pool of prefixes so that later requests share
    prefixes with earlier ones (hits in P's and D's caches)."""

    def __init__(self, seed: int, model_name: str, max_model_len: int = MAX_MODEL_LEN) -> None:
        self.rng = random.Random(seed)
        self.model = model_name
        self.max_len = max_model_len
        self.prefixes = [
            [self.rng.randrange(VOCAB) for _ in range(self.rng.choice([16, 32, 48, 100]))] for _ in range(4)
        ]
        self.n = 0

    def prompt_len(self) -> int:
        r = self.rng
        kind = r.random()
        if kind < 0.15:
            return r.choice([1, 2])
        if kind < 0.75:
            return r.choice([15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65])
        if kind < 0.85:
            return self.max_len - r.choice([1, 2, 5, 16, 17])
        return r.randrange(3, 120)

    def token_prompt(self, length: int) -> list[int]:
        r = self.rng
        if length > 3 and r.random() < 0.5:
            pre = r.choice(self.prefixes)[: r.choice([length, length - 1, length - BLOCK, length // 2])]
        else:
            pre = []
        return (pre + [r.randrange(VOCAB) for _ in range(length)])[:length]

    def text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def sampling(self, room: int, chat: bool) -> dict[str, Any]:
        r = self.rng
        b: dict[str, Any] = {}
        b["max_tokens"] = max(1, min(room, r.choice([1, 1, 2, 3, 5, 8, 12, 20, 40])))
        if r.random() < 0.5:
            b["temperature"] = 0.0
        else:
            b["temperature"] = r.choice([0.5, 0.8, 1.0, 1.5])
            b["seed"] = r.choice(
                [r.randrange(10_000), r.randrange(10_000), -r.randrange(1, 10), 2**63 - 1 - r.randrange(3)]
            )
            if r.random() < 0.4:
                b["top_p"] = r.choice([0.5, 0.9, 0.99])
            if r.random() < 0.4:
                b["top_k"] = r.choice([1, 5, 40])
        if r.random() < 0.5:
            b["ignore_eos"] = True
        if r.random() < 0.25:
            b["n"] = r.choice([2, 3])
        if r.random() < 0.3:
            b["presence_penalty"] = r.choice([-0.5, 0.7, 1.5])
        if r.random() < 0.3:
            b["frequency_penalty"] = r.choice([-0.5, 0.4, 1.2])
        if r.random() < 0.3:
            b["repetition_penalty"] = r.choice([0.8, 1.2, 2.0])
        if r.random() < 0.25:
            b["min_tokens"] = r.randrange(0, b["max_tokens"] + 1)
        if r.random() < 0.25:
            b["logit_bias"] = {
                str(r.randrange(VOCAB)): r.choice([-100, -5, 3, 8, 100]) for _ in range(r.randrange(1, 4))
            }
        if r.random() < 0.25:
            b["stop_token_ids"] = [r.randrange(512) for _ in range(r.randrange(1, 30))]
        if r.random() < 0.25:
            b["stop"] = [r.choice(["a", "e", " ", "o", "\n", "th", "x"]) for _ in range(r.randrange(1, 3))]
            if r.random() < 0.5:
                b["include_stop_str_in_output"] = True
        if r.random() < 0.4:
            if chat:
                b["logprobs"] = True
                if r.random() < 0.7:
                    b["top_logprobs"] = r.choice([0, 1, 3, 5])
            else:
                b["logprobs"] = r.choice([0, 1, 3, 5])
        if r.random() < 0.12:
            b["max_tokens"] = max(1, min(room, r.choice([64, 100, 200])))
        if r.random() < 0.3:
            b["stream"] = True
            if r.random() < 0.6:
                b["stream_options"] = {"include_usage": True, "continuous_usage_stats": r.random() < 0.3}
        return b

    def structured(self, chat: bool) -> dict[str, Any]:
        r = self.rng
        kind = r.choice(["json_schema", "regex", "choice", "json_object"])
        if kind == "json_schema":
            if chat and r.random() < 0.5:
                return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
            return {"structured_outputs": {"json": SCHEMA}}
        if kind == "regex":
            return {"structured_outputs": {"regex": r.choice([r"[a-c]{2,6}\d", r"(yes|no)!", r"\d{1,5}"])}}
        if kind == "choice":
            return {"structured_outputs": {"choice": ["red", "green", "blue", "reddish"]}}
        return {"response_format": {"type": "json_object"}}

    def next(self) -> Case:
        case = self._next()
        r = self.rng
        if r.random() < 0.05:
            case.body.update(stream=True, max_tokens=60, ignore_eos=True)
            case.abandon = True
            return case
        if r.random() < 0.3 and case.body.get("max_tokens", 2) > 1:
            kind = r.choice(["text", "id"])
            case.stop_from_output = (kind, r.choice([0, 0, 1, 2, r.randrange(8)]), r.choice([1, 1, 2, 3]))
            case.body.pop("stop", None)
            case.body.pop("stop_token_ids", None)
        return case

    def _next(self) -> Case:
        r = self.rng
        self.n += 1
        chat = r.random() < 0.35
        if chat:
            msgs = [{"role": "user", "content": self.text(r.randrange(1, 12))}]
            if r.random() < 0.3:
                msgs = [
                    {"role": "system", "content": "be brief"},
                    *msgs,
                    {"role": "assistant", "content": self.text(3)},
                    {"role": "user", "content": self.text(2)},
                ]
            body = {"model": self.model, "messages": msgs, **self.sampling(60, chat=True)}
            extra = r.random()
            if extra < 0.15:
                body.update(self.structured(chat=True))
                body["max_tokens"] = 60
            elif extra < 0.22:
                body.update(tools=TOOLS, tool_choice=r.choice(["required", "auto"]), max_tokens=80)
            return Case(self.n, "chat/completions", body)
        length = self.prompt_len()
        prompt: Any = self.token_prompt(length)
        if r.random() < 0.15:
            return Case(
                self.n,
                "completions",
                {"model": self.model, "prompt": prompt[: r.choice([1, 5, 16, 17])], **self.sampling(40, chat=False)},
                continues=True,
            )
        if r.random() < 0.2:
            prompt = self.text(max(1, length // 4))
        if r.random() < 0.1:  # a batch: all text or all token ids (a mixed one is a 400, as in vLLM)
            second = self.prompt_len() // 2 + 1
            prompt = [prompt, self.text(max(1, second // 4)) if isinstance(prompt, str) else self.token_prompt(second)]
        room = self.max_len - max(
            len(p) if isinstance(p, list) else len(p)
            for p in (prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str) else [prompt])
        )
        body = {"model": self.model, "prompt": prompt, **self.sampling(room, chat=False)}
        if r.random() < 0.15 and "logprobs" not in body:
            body["echo"] = True
        if r.random() < 0.08 and room >= 40:
            body.update(self.structured(chat=False))
            body["max_tokens"] = 40
        return Case(self.n, "completions", body)


def resolve_stop(client: httpx.Client, co_url: str, case: Case) -> None:
    """Fill in the stop a `stop_from_output` case asks for from the colocated cluster's output without stops."""
    if case.stop_from_output is None:
        return
    kind, pos, length = case.stop_from_output
    pilot = {**case.body, "stream": False, "n": 1}
    pilot.pop("stream_options", None)
    r = client.post(f"{co_url}/v1/{case.endpoint}", json=pilot)
    if r.status_code != 200:
        return
    choice = r.json()["choices"][0]
    if kind == "id" and choice.get("token_ids"):
        ids = choice["token_ids"]
        case.body["stop_token_ids"] = [ids[min(pos, len(ids) - 1)]]
    else:
        text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
        if case.body.get("echo") and isinstance(case.body.get("prompt"), str):
            text = text[len(case.body["prompt"]) :]
        pos = min(pos, max(0, len(text) - length))
        if text[pos : pos + length]:
            case.body["stop"] = [text[pos : pos + length]]
    case.stop_from_output = None


def resolve_continuation(case: Case, history: list[list[int]]) -> None:
    """Put a `continues` case's prompt after the latest earlier prompt + output (the colocated answer's)."""
    if case.continues and history:
        case.body["prompt"] = history[-1] + case.body["prompt"]
        case.body["max_tokens"] = max(1, min(case.body["max_tokens"], MAX_MODEL_LEN - len(case.body["prompt"])))
        case.continues = False


def _remember(case: Case, answer: dict[str, Any], history: list[list[int]]) -> None:
    prompt, body = case.body.get("prompt"), answer["body"]
    if (
        answer["status"] == 200
        and isinstance(prompt, list)
        and prompt
        and isinstance(prompt[0], int)
        and isinstance(body, dict)
    ):
        choices = body["choices"]
        first = choices[0] if isinstance(choices, list) else choices.get(0)
        if first and first.get("token_ids") and not case.body.get("echo"):
            history.append(list(prompt) + list(first["token_ids"]))


def call(client: httpx.Client, url: str, case: Case) -> dict[str, Any]:
    """The answer as one comparable object: status, and the body (a stream's chunks merged per choice)."""
    if not case.body.get("stream"):
        r = client.post(f"{url}/v1/{case.endpoint}", json=case.body)
        return {
            "status": r.status_code,
            "body": r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text,
        }
    chunks: list[Any] = []
    if case.abandon:
        with client.stream("POST", f"{url}/v1/{case.endpoint}", json=case.body) as r:
            for _ in r.iter_bytes():
                break  # hang up after the first bytes
        return {"status": "abandoned", "body": None}
    with client.stream("POST", f"{url}/v1/{case.endpoint}", json=case.body) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "body": r.text}
        done = False
        raw = b"".join(r.iter_bytes())  # SSE lines end at \n only (not at U+2028 &c. inside the JSON)
        for line in raw.decode().split("\n"):
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return {"status": 200, "body": merge_stream(chunks), "done": done}


def merge_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per choice index: text / content concatenated, token ids and logprob lists joined, the last finish reason;
    the last usage; error events kept."""
    choices: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {"choices": choices}
    for ch in chunks:
        if "error" in ch:
            out.setdefault("errors", []).append(ch["error"])
        if ch.get("usage"):
            out["usage"] = ch["usage"]
        for c in ch.get("choices", []):
            m = choices.setdefault(
                c["index"],
                {
                    "text": "",
                    "token_ids": [],
                    "finish_reason": None,
                    "stop_reason": None,
                    "logprobs": {},
                    "tool_calls": [],
                },
            )
            delta = c.get("delta", c)
            m["text"] += delta.get("text") or delta.get("content") or ""
            m["reasoning"] = m.get("reasoning", "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
            m["token_ids"] += c.get("token_ids") or []
            m["tool_calls"] += delta.get("tool_calls") or []
            if c.get("finish_reason") is not None:
                m["finish_reason"] = c["finish_reason"]
            if c.get("stop_reason") is not None:
                m["stop_reason"] = c["stop_reason"]
            lp = c.get("logprobs") or {}
            for k, v in lp.items():
                if isinstance(v, list):
                    m["logprobs"].setdefault(k, []).extend(v)
    return out


def constraint_violations(case: Case, answer: dict[str, Any]) -> list[str]:
    """A structured case's finished choices (finish_reason "stop") must match its constraint, whatever the cluster."""
    spec = case.body.get("structured_outputs") or {}
    fmt = case.body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        spec = {"json": fmt["json_schema"]["schema"]}
    body = answer["body"]
    if not spec or answer["status"] != 200 or not isinstance(body, dict) or case.body.get("echo"):
        return []
    choices = body["choices"]
    out = []
    for c in choices.values() if isinstance(choices, dict) else choices:
        text = c.get("text") if "text" in c else (c.get("message") or {}).get("content") or ""
        if c.get("finish_reason") != "stop" or case.body.get("stop") or case.body.get("stop_token_ids"):
            continue
        ok = True
        if "choice" in spec:
            ok = text in spec["choice"]
        elif "regex" in spec:
            ok = re.fullmatch(spec["regex"], text) is not None
        elif "json" in spec:
            try:
                jsonschema.validate(json.loads(text), spec["json"])
            except (ValueError, jsonschema.ValidationError):
                ok = False
        if not ok:
            out.append(f"choice {c.get('index')}: {text!r} does not match {_short(spec)}")
    return out


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ (floats within TOL; IGNORED_KEYS skipped)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k in IGNORED_KEYS:
                continue
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'pd' if k in a else 'colocated'}")
            else:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}: {_short(a)} vs {_short(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= TOL:
            return []
        if a != a and b != b:  # both NaN  # noqa: PLR0124
            return []
    if a != b:
        return [f"{path}: {_short(a)} != {_short(b)}"]
    return []


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) < 200 else s[:200] + "..."


def compare(
    pd_url: str,
    co_url: str,
    cases: list[Case],
    timeout: float = 120.0,
    statuses: dict[str, int] | None = None,
    concurrency: int = 1,
) -> list[tuple[Case, list[str]]]:
    """Send each case to both clusters and compare: `concurrency` cases at a time go to PD together, then the same
    cases to the colocated cluster together (batches of several requests on each worker). The cases whose answers
    differ, with the differences; a 5xx or an exception (hang: timeout) on either side is a difference too.
    `statuses` counts PD's answers (status, or finish reasons of a 200)."""
    bad = []
    statuses = {} if statuses is None else statuses
    history: list[list[int]] = []

    def one(client: httpx.Client, url: str, case: Case) -> dict[str, Any]:
        try:
            return call(client, url, case)
        except Exception as e:  # noqa: BLE001
            return {"status": "exception", "body": f"{type(e).__name__}: {e}"}

    with httpx.Client(timeout=timeout) as client, ThreadPoolExecutor(max(1, concurrency)) as pool:
        for at in range(0, len(cases), max(1, concurrency)):
            group = cases[at : at + max(1, concurrency)]
            for case in group:
                resolve_continuation(case, history)
                resolve_stop(client, co_url, case)
            answers = {url: list(pool.map(lambda c, u=url: one(client, u, c), group)) for url in (pd_url, co_url)}
            for case, got in zip(group, zip(answers[pd_url], answers[co_url], strict=True), strict=True):
                _remember(case, got[1], history)
                diffs = diff(got[0], got[1])
                diffs += [f"pd {v}" for v in constraint_violations(case, got[0])]
                diffs += [f"colocated {v}" for v in constraint_violations(case, got[1])]
                for key in _outcomes(got[0]):
                    statuses[key] = statuses.get(key, 0) + 1
                if any(
                    g["status"] not in (200, "abandoned")
                    and not (isinstance(g["status"], int) and 400 <= g["status"] < 500)
                    for g in got
                ):
                    diffs.append(
                        f"server error: pd {got[0]['status']} colocated {got[1]['status']}: {_short(got[0]['body'])}"
                    )
                if diffs:
                    bad.append((case, diffs))
    return bad


def _outcomes(answer: dict[str, Any]) -> list[str]:
    body = answer["body"]
    if answer["status"] != 200 or not isinstance(body, dict):
        return [f"{answer['status']}: {_short(body)[:80]}"]
    choices = body["choices"]
    hits = (body.get("usage") or {}).get("hybridpd") or {}
    return [
        f"finish={c.get('finish_reason')}" for c in (choices.values() if isinstance(choices, dict) else choices)
    ] + [
        f"hit:{k}" for k in ("prefill_cached_tokens", "decode_local_cached_tokens", "transferred_tokens") if hits.get(k)
    ]


def stop_all(clusters: list[Any]) -> None:
    with ThreadPoolExecutor(max(1, len(clusters))) as pool:
        list(pool.map(lambda c: c.stop(), clusters))


def leftovers(clusters: list[Any], wait_s: float = 20.0) -> list[str]:
    """What the clusters' workers still hold once every request has ended (pages in use, pinned leases, a failed
    integrity check); waits up to `wait_s` for aborts and releases to land."""
    deadline = time.time() + wait_s
    while True:
        stats = [c.worker_stats(w) for c in clusters for w in c.prefill + c.decode]
        held = [f"{s.role} {p.kind}: {p.in_use} pages in use" for s in stats for p in s.pools if p.in_use]
        held += [f"{s.role}: {s.leases_pinned} leases pinned" for s in stats if s.leases_pinned]
        held += [f"{s.role} {p.kind}: integrity check failed" for s in stats for p in s.pools if not p.integrity_ok]
        if not held or time.time() > deadline:
            return held
        time.sleep(0.5)


def transfer_failures(cluster: Any) -> dict[str, float]:
    """The decode workers' failed KV pulls by reason (a failed pull is computed locally: right output, no PD)."""
    out: dict[str, float] = {}
    for w in cluster.decode:
        text = httpx.get(f"http://127.0.0.1:{w.info['metrics_port']}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("hybridpd_kv_transfer_failures_total{") and float(line.rsplit(" ", 1)[1]):
                key = line.rsplit(" ", 1)[0].split("{", 1)[1].rstrip("}")
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def make_model(family: str, out_dir: str) -> str:
    from hybridpd.engine.models.checkpoint import write_random_checkpoint

    kind, overrides = FAMILIES[family]
    return write_random_checkpoint(out_dir, kind, seed=0, **overrides)


def start_pair(
    model: str,
    max_model_len: int = MAX_MODEL_LEN,
    pd_proxy_args: list[str] | None = None,
    worker_args: list[str] | None = None,
    prefill_args: list[str] | None = None,
    decode_args: list[str] | None = None,
) -> tuple[Any, Any]:
    """A 1P1D cluster and a colocated one on `model`, started at the same time. `pd_proxy_args`: more flags of the
    PD cluster's proxy (e.g. `--routing cache_aware --prefill-decode always`: whole requests on the prefill
    worker). `prefill_args` / `decode_args`: more flags of the PD cluster's prefill / decode worker only (e.g.
    `--tensor-parallel-size 2` on one role: PD between different TP sizes)."""
    from hybridpd.deploy.local_cluster import start_cluster

    args = [
        "--max-model-len",
        str(max_model_len),
        "--checkpoint-interval",
        "32",
        "--kv-cache-memory-bytes",
        str(32 * 2**20),
        *(worker_args or []),
    ]
    proxy = ["--max-model-len", str(max_model_len)]
    with ThreadPoolExecutor(2) as pool:
        pd = pool.submit(
            start_cluster,
            model,
            worker_args=args,
            proxy_args=[*proxy, *(pd_proxy_args or [])],
            prefill_args=prefill_args,
            decode_args=decode_args,
        )
        co = pool.submit(start_cluster, model, colocated=True, worker_args=args, proxy_args=proxy)
        return pd.result(), co.result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append")
    ap.add_argument("--pd-url", help="an already running PD proxy (with --colocated-url): no clusters started")
    ap.add_argument("--colocated-url")
    ap.add_argument("--model-name", default=None)
    ap.add_argument("--worker-args", default="", help="more flags of every worker, e.g. '--block-size 32'")
    ap.add_argument("--prefill-args", default="", help="more flags of the PD prefill worker only")
    ap.add_argument("--decode-args", default="", help="more flags of the PD decode worker only")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once on each cluster")
    ap.add_argument(
        "--pd-proxy-args",
        default="",
        help="more flags of the PD proxy, e.g. '--routing cache_aware "
        "--prefill-decode always' (whole requests on the prefill worker) or '--skip-prefill always'",
    )
    args = ap.parse_args(argv)
    failures = 0
    for family in args.family or sorted(FAMILIES):
        t0 = time.time()
        if args.pd_url:
            pd_url, co_url, name, stop = args.pd_url, args.colocated_url, args.model_name or "", None
        else:
            model = make_model(family, tempfile.mkdtemp(prefix=f"pd-diff-{family}-"))
            pd, co = start_pair(
                model,
                pd_proxy_args=args.pd_proxy_args.split(),
                worker_args=args.worker_args.split(),
                prefill_args=args.prefill_args.split(),
                decode_args=args.decode_args.split(),
            )
            pd_url, co_url, name, stop = pd.url, co.url, pd.model_name, (pd, co)
        try:
            gen = RequestGen(args.seed, name)
            cases = [gen.next() for _ in range(args.requests)]
            t1 = time.time()
            statuses: dict[str, int] = {}
            bad = compare(pd_url, co_url, cases, statuses=statuses, concurrency=args.concurrency)
            if stop:
                failed = transfer_failures(stop[0])
                if failed:
                    print(f"{family}: failed KV pulls on D (computed locally): {failed}")
                held = leftovers(list(stop))
                if held:
                    print(f"{family}: after the requests, workers still hold: {held}")
                    failures += 1
        finally:
            if stop:
                stop_all(list(stop))
        kinds = {
            "chat": sum(c.endpoint.startswith("chat") for c in cases),
            "stream": sum(bool(c.body.get("stream")) for c in cases),
            "sampled": sum(bool(c.body.get("temperature")) for c in cases),
            "n>1": sum(c.body.get("n", 1) > 1 for c in cases),
        }
        for case, diffs in bad:
            print(f"[{family} #{case.index}] {case.endpoint} {json.dumps(case.body)}")
            for d in diffs[:8]:
                print(f"    {d}")
        print(
            f"{family}: {len(cases)} requests {kinds}, {len(bad)} differ; start {t1 - t0:.1f} s, "
            f"requests {time.time() - t1:.1f} s",
            flush=True,
        )
        print(f"    PD outcomes: {json.dumps(dict(sorted(statuses.items(), key=lambda kv: -kv[1])))}")
        failures += len(bad)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
