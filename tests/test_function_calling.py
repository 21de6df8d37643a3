"""Function calling: BFCL data, the AST checker, the tool-call format, tools in the servers,
and bundles that ship a fine-tune as a LoRA adapter."""

import json
from pathlib import Path

import pytest

from specstream_mlx.tasks import bfcl
from specstream_mlx.tasks.ast_check import check_calls
from specstream_mlx.tasks.tool_calls import (
    ToolCall,
    ToolError,
    check_tools,
    format_calls,
    parse_tool_calls,
    tools_system_message,
    with_tools,
)

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {
        "type": "dict",
        "properties": {
            "city": {"type": "string", "description": "City name."},
            "unit": {"type": "string", "description": "celsius or fahrenheit"},
            "days": {"type": "integer", "description": "Forecast days."},
        },
        "required": ["city"],
    },
}
AREA = {
    "name": "math.area",
    "description": "Area of a rectangle.",
    "parameters": {
        "type": "dict",
        "properties": {
            "width": {"type": "float", "description": "Width."},
            "height": {"type": "float", "description": "Height."},
            "sides": {"type": "array", "items": {"type": "integer"}, "description": "Sides."},
            "meta": {
                "type": "dict",
                "properties": {"owner": {"type": "string"}, "tag": {"type": "string"}},
                "description": "Meta.",
            },
        },
        "required": ["width", "height"],
    },
}


def _write_tiny_bfcl(root: Path) -> Path:
    """A BFCL-shaped data folder: three categories, good items and bad ones."""
    data = root / "data"
    (data / "possible_answer").mkdir(parents=True)

    def q(i, text, fns, cat):
        return {"id": f"{cat}_{i}", "question": [[{"role": "user", "content": text}]], "function": fns}

    items = {
        "simple_python": [
            (
                q(0, "Weather in Paris?", [WEATHER], "simple_python"),
                [{"get_weather": {"city": ["Paris"], "unit": ["", "celsius"]}}],
            ),
            # a required argument BFCL also marks omittable: kept, with its first real value
            (q(1, "Area 2 by 3", [AREA], "simple_python"), [{"math.area": {"width": ["", 2.0], "height": [3.0]}}]),
        ],
        "parallel": [
            (
                q(0, "Weather in Paris and Rome for 3 days", [WEATHER], "parallel"),
                [{"get_weather": {"city": ["Paris"], "days": [3]}}, {"get_weather": {"city": ["Rome"], "days": [3]}}],
            )
        ],
        "multiple": [
            (
                q(0, "Area 2 by 3 owned by Ann", [WEATHER, AREA], "multiple"),
                [{"math.area": {"width": [2.0], "height": [3.0], "meta": [{"owner": ["Ann"], "tag": [""]}]}}],
            )
        ],
    }
    for cat, rows in items.items():
        qs = [json.dumps(r) for r, _ in rows]
        ans = [json.dumps({"id": r["id"], "ground_truth": a}) for r, a in rows]
        if cat == "simple_python":
            qs += ["{not json", json.dumps(q(9, "no answer", [WEATHER], cat))]
            qs.append(
                json.dumps(
                    {
                        "id": "simple_python_8",
                        "question": [[{"role": "user", "content": "a"}], []],
                        "function": [WEATHER],
                    }
                )
            )
            ans.append(json.dumps({"id": "simple_python_8", "ground_truth": [{"get_weather": {"city": ["x"]}}]}))
        (data / f"BFCL_v4_{cat}.json").write_text("\n".join(qs) + "\n")
        (data / "possible_answer" / f"BFCL_v4_{cat}.json").write_text("\n".join(ans) + "\n")
    return data


def test_bfcl_records_become_canonical_calls_and_bad_ones_are_counted(tmp_path):
    rep = bfcl.read_bfcl(_write_tiny_bfcl(tmp_path), categories=("simple_python", "parallel", "multiple"))
    by_id = {it.id: it for it in rep.items}
    assert sorted(by_id) == ["multiple_0", "parallel_0", "simple_python_0", "simple_python_1"]
    assert rep.skipped == {"unparsable record": 1, "no usable answer": 1, "not single-turn": 1}
    # first acceptable value; an omittable optional argument left out
    assert by_id["simple_python_0"].target() == [ToolCall("get_weather", {"city": "Paris"})]
    # an omittable argument the schema requires is kept, with its first non-empty value
    assert by_id["simple_python_1"].target() == [ToolCall("math.area", {"width": 2.0, "height": 3.0})]
    # nested answers reduce the same way
    assert by_id["multiple_0"].target()[0].arguments == {"width": 2.0, "height": 3.0, "meta": {"owner": "Ann"}}
    # parallel calls: a list, in the answer's order; a single call: one object
    par = format_calls(by_id["parallel_0"].target())
    assert json.loads(par) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        {"name": "get_weather", "arguments": {"city": "Rome", "days": 3}},
    ]
    assert json.loads(format_calls(by_id["simple_python_0"].target())) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    # every canonical target passes the checker; the row shows the tools in a system turn
    for it in rep.items:
        assert check_calls(it.target(), it.ground_truth, it.tools, it.category).valid
    row = bfcl.chat_row(by_id["simple_python_0"])
    assert row["messages"][0]["role"] == "system" and '"name":"get_weather"' in row["messages"][0]["content"]
    assert row["messages"][-1] == {
        "role": "assistant",
        "content": '{"name":"get_weather","arguments":{"city":"Paris"}}',
    }


def test_the_split_is_a_function_of_the_id_and_prepare_writes_it(tmp_path, tiny_model_dir):
    from specstream_mlx.io.loading import load_tokenizer

    assert [bfcl.split_of(f"x_{i}") for i in range(200)] == [bfcl.split_of(f"x_{i}") for i in range(200)]
    shares = [bfcl.split_of(f"x_{i}") for i in range(4000)]
    assert 0.07 < shares.count("test") / 4000 < 0.13 and 0.03 < shares.count("valid") / 4000 < 0.07
    root = _write_tiny_bfcl(tmp_path)
    tok = load_tokenizer(tiny_model_dir)
    res = bfcl.prepare(tmp_path / "out", tok, max_tokens=None, root=root)
    rows = [json.loads(line) for s in ("train", "valid", "test") for line in open(tmp_path / "out" / f"{s}.jsonl")]
    assert len(rows) == 4 == sum(res.counts.values())
    for r in rows:
        assert bfcl.split_of(r["id"]) in ("train", "valid", "test")
    # a length cap drops long train/valid items (counted), never test items
    res = bfcl.prepare(tmp_path / "short", tok, max_tokens=10, root=root)
    kept = res.counts["train"] + res.counts["valid"]
    assert kept == 0 and res.too_long["train"] + res.too_long["valid"] == 4 - res.counts["test"]


def test_the_real_bfcl_data_when_installed():
    """With bfcl-eval installed (CI installs it): every usable item's canonical call passes
    BFCL's rule, and the test split is the one listed in the repository."""
    try:
        root = bfcl.data_dir()
    except bfcl.BFCLError:
        root = None
    listed = Path(bfcl.__file__).with_name("bfcl_test_ids.txt").read_text().split("\n")
    listed = [x for x in listed if x and not x.startswith("#")]
    if root is None:  # the package is absent: the listed ids still follow the split rule
        assert all(bfcl.split_of(i) == "test" for i in listed)
        return
    rep = bfcl.read_bfcl(root)
    assert len(rep.items) == 2345 and sum(rep.skipped.values()) == 6
    for it in rep.items:
        assert check_calls(it.target(), it.ground_truth, it.tools, it.category).valid, it.id
    assert sorted(it.id for it in rep.items if bfcl.split_of(it.id) == "test") == listed


GT = [{"get_weather": {"city": ["Paris", "Paris, France"], "unit": ["", "celsius"], "days": ["", 1]}}]


@pytest.mark.parametrize(
    "calls,ok",
    [
        ([ToolCall("get_weather", {"city": "Paris"})], True),
        ([ToolCall("get_weather", {"city": "paris, france", "unit": "Celsius"})], True),  # standardized strings
        ([ToolCall("get_weather", {"city": "Paris", "days": 1})], True),
        ([ToolCall("get_weather", {"city": "Paris", "days": 1.0})], False),  # float where integer expected
        ([ToolCall("get_weather", {"city": "London"})], False),
        ([ToolCall("get_weather", {"unit": "celsius"})], False),  # required argument missing
        ([ToolCall("get_weather", {"city": "Paris", "country": "FR"})], False),  # unknown argument
        ([ToolCall("get_forecast", {"city": "Paris"})], False),
        ([ToolCall("get_weather", {"city": "Paris"})] * 2, False),  # one call expected
        (None, False),
    ],
)
def test_ast_checker_simple(calls, ok):
    assert check_calls(calls, GT, [WEATHER], "simple_python").valid is ok


def test_ast_checker_types_lists_objects_and_parallel_order():
    gt = [
        {
            "math.area": {
                "width": [2.0],
                "height": [3.0],
                "sides": [[1, 2]],
                "meta": ["", {"owner": ["Ann"], "tag": [""]}],
            }
        }
    ]
    good = ToolCall("math.area", {"width": 2, "height": 3.0, "sides": [1, 2], "meta": {"owner": "ann"}})
    assert check_calls([good], gt, [AREA], "simple_python").valid  # an integer passes for a float
    for bad in (
        {"width": 2, "height": 3.0, "sides": [2, 1]},  # lists compare in order
        {"width": 2, "height": 3.0, "meta": {"owner": "Ann", "extra": "x"}},  # unknown key in an object
        {"width": "2", "height": 3.0},  # a string for a float
    ):
        assert not check_calls([ToolCall("math.area", bad)], gt, [AREA], "simple_python").valid, bad
    par = [{"get_weather": {"city": ["Paris"]}}, {"get_weather": {"city": ["Rome"]}}]
    rome, paris = ToolCall("get_weather", {"city": "Rome"}), ToolCall("get_weather", {"city": "Paris"})
    assert check_calls([rome, paris], par, [WEATHER], "parallel").valid  # any order
    assert not check_calls([rome, rome], par, [WEATHER], "parallel").valid  # each answer matched once
    assert not check_calls([rome], par, [WEATHER], "parallel").valid


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut off
        '{"name": "get_weather", "arguments": "Paris"}',
        '{"name": "get_weather", "arguments": {}, "extra": 1}',
        '{"name": "launch_rockets", "arguments": {}}',  # not among the tools
        "[]",
        '[{"name": "get_weather", "arguments": {}}, 3]',
        "[" * 100000,
        '{"name": 5}',
    ],
)
def test_malformed_replies_are_plain_text(text):
    assert parse_tool_calls(text, ["get_weather"]) is None


def test_replies_that_are_calls_parse():
    assert parse_tool_calls(' {"name":"get_weather","arguments":{"city":"Paris"}}\n', ["get_weather"]) == [
        ToolCall("get_weather", {"city": "Paris"})
    ]
    fenced = '```json\n[{"name":"get_weather","arguments":{"city":"Rome"}}]\n```'
    assert parse_tool_calls(fenced, ["get_weather"]) == [ToolCall("get_weather", {"city": "Rome"})]


def test_tool_definitions_are_checked_and_shown():
    assert check_tools([{"type": "function", "function": WEATHER}]) == [WEATHER]
    for bad, field in (
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"name": "f", "parameters": {"properties": []}}], "tools[0].parameters.properties"),
        ([{"name": "f", "parameters": {"required": [1]}}], "tools[0].parameters.required"),
        ([], "tools"),
        ("f", "tools"),
    ):
        with pytest.raises(ToolError, match=field.replace("[", r"\[").replace("]", r"\]")):
            check_tools(bad)
    msgs = with_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [WEATHER])
    assert len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.\n\n")
    assert msgs[0]["content"].endswith(tools_system_message([WEATHER]))


# --- tools in the servers -----------------------------------------------------------------


class _Handler:
    """An ApiHandler whose socket is a buffer: replies are shaped exactly as served."""

    @staticmethod
    def make(tools):
        import email.message
        import io
        import types

        from specstream_mlx.serve.http import ApiHandler, HttpOptions

        h = ApiHandler.__new__(ApiHandler)
        h.wfile, h.headers = io.BytesIO(), email.message.Message()
        h.request_version, h.requestline, h.command, h.client_address = "HTTP/1.1", "POST /", "POST", ("t", 0)
        h.app = types.SimpleNamespace(model_id="m", options=HttpOptions())
        return h


def _request(tools, stream):
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.serve.protocol import GenerationRequest

    return GenerationRequest("r1", None, [1, 2, 3], 64, SamplingParams(), "ar", [], stream=stream, tools=tools)


def _events(pieces, finish="stop"):
    import queue

    from specstream_mlx.runtime.session import Reply

    q = queue.Queue()
    for p in pieces:
        q.put(("delta", p))
    q.put(("done", Reply(text="".join(pieces), tokens=[0] * len(pieces), finish_reason=finish)))
    return q


def _sse_chunks(h):
    body = h.wfile.getvalue().decode().split("\r\n\r\n", 1)[1]
    return [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]


CALL_PIECES = [' {"name":"get_', 'weather","arguments":', '{"city":"Paris"}}']


def test_http_replies_carry_tool_calls_streamed_or_not():
    h = _Handler.make([WEATHER])
    final = h._final(True, _request([WEATHER], False), 0, _events(CALL_PIECES).queue[-1][1])
    choice = final["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    h._stream(True, _request([WEATHER], True), 0, _events(CALL_PIECES))
    chunks = _sse_chunks(h)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)  # a call is never streamed as text
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "pieces,finish",
    [
        (["It is ", "sunny."], "stop"),  # prose streams as it comes
        (['{"name":"get_weather",', '"arguments":{"ci'], "length"),  # a cut-off call is text
        (['{"name":"nuke","arguments":{}}'], "stop"),  # a function not offered is text
    ],
)
def test_http_replies_that_are_not_calls_stay_text(pieces, finish):
    h = _Handler.make([WEATHER])
    h._stream(True, _request([WEATHER], True), 0, _events(pieces, finish))
    chunks = _sse_chunks(h)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "".join(pieces) and not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == ("length" if finish == "length" else "stop")
    final = _Handler.make([WEATHER])._final(True, _request([WEATHER], False), 0, _events(pieces, finish).queue[-1][1])
    assert final["choices"][0]["message"]["content"] == "".join(pieces)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tiny_model_dir):
    """The tiny model declaring the tool-call format (its replies are noise, never calls)."""
    import shutil

    from specstream_mlx.tasks.tool_calls import write_tools_file

    dst = tmp_path_factory.mktemp("tools") / "m"
    shutil.copytree(tiny_model_dir, dst)
    write_tools_file(dst)
    return dst


def test_http_tools_requests(tool_model, tiny_model_dir):
    from tests.test_serve import _post, _start_server

    tools = [{"type": "function", "function": WEATHER}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    proc, port = _start_server(tool_model, "--max-context", "2048")
    try:
        status, _, body = _post(port, {"messages": msgs, "tools": tools, "max_tokens": 8})
        reply = json.loads(body)
        assert status == 200 and isinstance(reply["choices"][0]["message"]["content"], str)
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        history = msgs + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        ]
        status, _, _ = _post(port, {"messages": history, "tools": tools, "tool_choice": "auto", "max_tokens": 4})
        assert status == 200
        for body, code, needle in (
            (
                {"messages": msgs, "tools": [{"type": "function", "function": {"name": ""}}]},
                400,
                "tools[0].function.name",
            ),
            ({"messages": msgs, "tools": tools, "tool_choice": "required"}, 400, "tool_choice"),
            ({"messages": msgs, "tools": tools, "tool_choice": {"type": "function"}}, 400, "tool_choice"),
        ):
            status, _, out = _post(port, body)
            assert status == code and needle in json.loads(out)["error"]["message"], out
        status, _, out = _post(port, {"prompt": "hi", "tools": tools}, path="/v1/completions")
        assert status == 400 and "chat/completions" in json.loads(out)["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, port = _start_server(tiny_model_dir)  # no tool-call format: tools refused in one line
    try:
        status, _, out = _post(port, {"messages": msgs, "tools": tools})
        assert status == 400 and "not fine-tuned with a tool-call format" in json.loads(out)["error"]["message"]
        status, _, _ = _post(port, {"messages": msgs, "tools": tools, "tool_choice": "none", "max_tokens": 2})
        assert status == 200  # "none": the tools are not shown, so any model answers
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_stdio_tools_requests(tool_model, tiny_model_dir):
    import subprocess

    from tests.test_serve import CLI

    tools = [WEATHER]
    lines = [
        {"id": 1, "messages": [{"role": "user", "content": "Weather?"}], "tools": tools, "max_tokens": 4},
        {"id": 2, "prompt": "hi", "tools": [{"name": "f", "parameters": {"required": "x"}}]},
        {"id": 3, "prompt": "hi", "tools": tools, "tool_choice": "any"},
    ]
    stdin = "".join(json.dumps(x) + "\n" for x in lines)
    for model, first in ((tool_model, "done"), (tiny_model_dir, "error")):
        r = subprocess.run(
            [*CLI, "serve", "--stdio", "--model", str(model)], input=stdin, capture_output=True, text=True, timeout=120
        )
        events = [json.loads(x) for x in r.stdout.splitlines()]
        last = {e["id"]: e for e in events if e.get("id") is not None}
        assert r.returncode == 0 and last[1]["event"] == first, r.stderr
        if first == "error":
            assert "tool-call format" in last[1]["message"]
        assert last[2]["event"] == "error" and "tools[0].parameters.required" in last[2]["message"]
        assert last[3]["event"] == "error" and "tool_choice" in last[3]["message"]


# --- a bundle that ships a fine-tune as a LoRA adapter ------------------------------------

from tests.test_bundles import fake_package  # noqa: E402,F401  (the fixture)


def test_a_bundle_fuses_its_shipped_adapter_into_the_dequantized_base(fake_package, tmp_path):  # noqa: F811
    import mlx.core as mx

    from specstream_mlx.convert import ConvertOptions, convert_gguf
    from specstream_mlx.io import bundles
    from specstream_mlx.io.fingerprint import base_fingerprint
    from specstream_mlx.tasks.tool_calls import model_tool_format, write_tools_file

    gguf = fake_package.parent.parent / "site" / "tiny_gguf_pkg" / "tiny.gguf"
    base = convert_gguf(str(gguf), str(tmp_path / "f16"), ConvertOptions(dequantize=True))
    assert "quantization" not in json.loads((base / "config.json").read_text())
    weights = mx.load(str(base / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj"
    w = weights[key + ".weight"]
    mx.random.seed(0)
    a = (0.1 * mx.random.normal((w.shape[1], 4))).astype(mx.float16)
    b = (0.1 * mx.random.normal((4, w.shape[0]))).astype(mx.float16)
    mx.save_safetensors(str(fake_package / "adapters.safetensors"), {key + ".lora_a": a, key + ".lora_b": b})
    adapter_cfg = {"fine_tune_type": "lora", "lora_parameters": {"rank": 4, "scale": 2.0}}
    (fake_package / "adapter_config.json").write_text(
        json.dumps(dict(adapter_cfg, base_fingerprint=base_fingerprint(base)))
    )
    desc = json.loads((fake_package / "bundle.json").read_text())
    (fake_package / "bundle.json").write_text(json.dumps(dict(desc, adapter="adapters.safetensors")))
    write_tools_file(fake_package)

    dst = bundles.materialize(bundles.read_bundle(fake_package), log=lambda s: None)
    fused = mx.load(str(dst / "model.safetensors"))
    want = w.astype(mx.float32) + 2.0 * (a.astype(mx.float32) @ b.astype(mx.float32)).T
    assert mx.allclose(fused[key + ".weight"].astype(mx.float32), want, atol=2e-3).item()
    others = [k for k in weights if k != key + ".weight"]
    assert all(mx.array_equal(fused[k], weights[k]).item() for k in others)
    assert model_tool_format(dst) is not None  # tools.json travels with the streams files
    # a changed adapter is fused again; one trained on another base is refused in one line
    (fake_package / "adapter_config.json").write_text(json.dumps(dict(adapter_cfg, base_fingerprint="0" * 16)))
    mx.save_safetensors(str(fake_package / "adapters.safetensors"), {key + ".lora_a": a * 2, key + ".lora_b": b})
    with pytest.raises(bundles.BundleError, match="trained on base 0000000000000000"):
        bundles.materialize(bundles.read_bundle(fake_package), log=lambda s: None)


# --- the shipped fine-tune ----------------------------------------------------------------

FC_PROMPT = [{"role": "user", "content": "What is the weather like in Paris today? Use celsius."}]


def test_smollm2_fc_decodes_losslessly():
    """Greedy speculative decoding of the shipped fine-tune equals its plain decoding."""
    from specstream_mlx import generate, load

    m, tok = load("smollm2-fc")
    assert m.streams is not None and m.streams.config.mode == "lossless"  # streams trained on the fine-tune
    messages = with_tools(FC_PROMPT, [WEATHER])
    ar = generate(m, tok, messages, max_tokens=40, mode="ar")
    for tree in ("dynamic:8", "chain:4"):
        ss = generate(m, tok, messages, max_tokens=40, mode="ss", tree=tree)
        assert ss.tokens == ar.tokens, tree
    assert parse_tool_calls(ar.text, ["get_weather"]), ar.text  # the fine-tune answers with a call


def test_smollm2_fc_serves_tool_calls_to_the_openai_client():
    from openai import OpenAI

    from tests.test_serve import _start_server

    proc, port = _start_server("smollm2-fc", "--max-context", "2048")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        tools = [{"type": "function", "function": WEATHER}]
        kw = dict(model="smollm2-fc", messages=FC_PROMPT, tools=tools, max_tokens=64, temperature=0)
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert "paris" in str(args.get("city", "")).lower()
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            assert not delta.content
            for c in delta.tool_calls or []:
                got = calls.setdefault(c.index, {"name": "", "arguments": ""})
                got["name"] += c.function.name or ""
                got["arguments"] += c.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"]) == args
        # tool_choice "none": the tools are not shown, the reply is text
        r = client.chat.completions.create(**dict(kw, tool_choice="none", max_tokens=8))
        assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_generate_and_chat_take_a_tools_file(tool_model, tiny_model_dir, tmp_path):
    import subprocess

    from tests.test_serve import CLI

    good, bad = tmp_path / "tools.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"tools": [{"type": "function", "function": WEATHER}]}))
    bad.write_text(json.dumps([{"name": "f", "parameters": {"required": "city"}}]))

    def gen(model, tools, *extra):
        cmd = [*CLI, "generate", "--model", str(model), "--prompt", "Weather?", "-m", "3", "--tools", str(tools)]
        return subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=120)

    r = gen(tool_model, good, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] in ("stop", "length") and "tool_calls" not in out  # noise, not a call
    for model, tools, needle in (
        (tool_model, bad, "bad.json[0].parameters.required"),
        (tool_model, tmp_path / "missing.json", "cannot read"),
        (tiny_model_dir, good, "has no tool-call format"),
    ):
        r = gen(model, tools)
        errors = [line for line in r.stderr.splitlines() if "error:" in line]
        assert r.returncode == 1 and len(errors) == 1 and needle in errors[0], r.stderr
        assert "Traceback" not in r.stderr
    r = gen(tool_model, good, "--ignore-chat-template")
    assert r.returncode == 1 and "--tools needs the chat template" in r.stderr
    r = subprocess.run(
        [*CLI, "chat", "--model", str(tiny_model_dir), "--tools", str(good)],
        input="",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "has no tool-call format" in r.stderr


def test_a_bundle_naming_a_missing_or_foreign_adapter_is_one_line(fake_package):  # noqa: F811
    from specstream_mlx.io import bundles

    desc = json.loads((fake_package / "bundle.json").read_text())
    for adapter, needle in (("adapters.safetensors", "missing"), ("../x/adapter_model.bin", "adapters.safetensors")):
        (fake_package / "bundle.json").write_text(json.dumps(dict(desc, adapter=adapter)))
        with pytest.raises(bundles.BundleError, match=needle):
            bundles.materialize(bundles.read_bundle(fake_package), log=lambda s: None)
