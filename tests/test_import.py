"""Routing import: canonical CSV, vLLM routed-experts responses, SGLang per_token dumps.

Each test writes files in the engine's own format (as its source writes them; see
docs/guide/import.md) from known routing, imports them, and checks the trace holds exactly that
routing, with the right phases, positions and sizes.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from tensorbend.capture.trace import Trace
from tensorbend.engines.importers import ImportConfig, import_trace
from tensorbend.engines.importers.csv import write_csv
from tensorbend.errors import TraceError


def planted_routing(prompts=12, L=3, E=16, K=2, prefill=5, decode=4, seed=0):
    """{prompt id: (ids [T, L, K], phase [T])}: layer m's experts are a fixed permutation of
    layer m-1's (so a transition table predicts them exactly)."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(E) for _ in range(L)]
    out = {}
    for i in range(prompts):
        T = prefill + decode
        first = np.stack([rng.permutation(E)[:K] for _ in range(T)])
        layers = [first]
        for m in range(1, L):
            layers.append(perms[m][layers[-1]])
        phase = np.r_[np.zeros(prefill, int), np.ones(decode, int)]
        out[f"p{i:03d}"] = (np.stack(layers, 1), phase)
    return out


def csv_rows(routing):
    for pid, (ids, phase) in routing.items():
        for t in range(ids.shape[0]):
            for m in range(ids.shape[1]):
                yield pid, m, t, ids[t, m].tolist(), ("prefill", "decode")[phase[t]]


def assert_trace_equals(out, routing, positions=None):
    tr = Trace.open(out)
    rows = tr.load(("ids",))
    ids = {p["id"]: i for i, p in enumerate(tr.prompts)}
    assert set(ids) == set(routing)
    for pid, (want, phase) in routing.items():
        sel = rows["prompt_index_T"] == ids[pid]
        assert torch.equal(rows["expert_ids_TLK"][sel].long(), torch.from_numpy(want))
        assert rows["phase_T"][sel].tolist() == phase.tolist()
        pos = positions[pid] if positions else list(range(len(phase)))
        assert rows["positions_T"][sel].tolist() == pos
    return tr


def test_csv_round_trip_sizes_phases_and_info(tmp_path):
    routing = planted_routing(L=3, E=16, K=2)
    src = write_csv(tmp_path / "r.csv", csv_rows(routing))
    res = import_trace(ImportConfig(source="csv", path=src, out=tmp_path / "t", progress=False))
    tr = assert_trace_equals(tmp_path / "t", routing)
    info = tr.info()
    assert (info["num_moe_layers"], info["top_k"], info["hidden_size"]) == (3, 2, 0)
    assert info["num_experts"] == max(int(v[0].max()) for v in routing.values()) + 1
    assert info["features"] == ["ids"] and info["complete"]
    assert info["family"] == "imported" and tr.router_params() == {}
    assert res.tokens == {"prefill": 12 * 5, "decode": 12 * 4}
    assert sorted(res.inferred) == ["num_experts", "num_layers", "top_k"]
    assert res.to_json()["prompts"] == 12
    cli = subprocess.run(
        [sys.executable, "-m", "tensorbend", "trace", "info", str(tmp_path / "t"), "--json"],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["num_moe_layers"] == 3


def test_trace_export_writes_the_csv_that_imports_back_to_the_same_routing(tmp_path):
    """`tensorbend trace export` (routing out as the canonical CSV) then `trace import`: every
    prompt's ids, phases and positions come back; the prompts keep their ids (and splits)."""
    routing = planted_routing(prompts=7, L=3, E=16, K=2)
    src = write_csv(tmp_path / "r.csv", csv_rows(routing))
    import_trace(ImportConfig(source="csv", path=src, out=tmp_path / "a", progress=False))
    cli = subprocess.run(
        [sys.executable, "-m", "tensorbend", "trace", "export", str(tmp_path / "a"),
         "--out", str(tmp_path / "out.csv")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "7 prompts, 63 tokens x 3 MoE layers" in cli.stdout
    import_trace(ImportConfig(source="csv", path=tmp_path / "out.csv", out=tmp_path / "b",
                              progress=False))  # fmt: skip
    b = assert_trace_equals(tmp_path / "b", routing)
    a = Trace.open(tmp_path / "a")
    assert [(p["id"], p["split"]) for p in b.prompts] == [(p["id"], p["split"]) for p in a.prompts]


def test_csv_rows_in_any_order_within_a_prompt_and_stated_sizes(tmp_path):
    routing = planted_routing(prompts=3, L=2, E=8, K=2)
    rows = list(csv_rows(routing))
    shuffled = []
    for pid in routing:  # prompts stay contiguous, their rows are reversed
        shuffled += [r for r in rows if r[0] == pid][::-1]
    src = write_csv(tmp_path / "r.csv", iter(shuffled))
    cfg = ImportConfig(
        source="csv",
        path=src,
        out=tmp_path / "t",
        num_experts=40,
        top_k=2,
        moe_layer_ids=(1, 3),
        progress=False,
    )
    import_trace(cfg)
    tr = assert_trace_equals(tmp_path / "t", routing)
    assert tr.spec.num_experts == 40 and tr.spec.moe_layer_ids == (1, 3)


def test_csv_without_phase_uses_the_default_phase(tmp_path):
    src = tmp_path / "r.csv"
    src.write_text("prompt_id,layer,position,expert_ids\na,0,0,1 2\na,0,1,2 3\n\nb,0,0,0 1\n")
    import_trace(
        ImportConfig(
            source="csv", path=src, out=tmp_path / "t", progress=False, default_phase="prefill"
        )
    )
    assert Trace.open(tmp_path / "t").info()["tokens"] == {"prefill": 3, "decode": 0}


@pytest.mark.parametrize(
    "body, message",
    [
        ("prompt,layer,position,expert_ids\n", "lacks ['prompt_id']"),
        ("prompt_id,layer,position,expert_ids\na,0,x,1 2\n", "line 2"),
        (
            "prompt_id,layer,position,expert_ids\na,0,0,1 2\na,0,1,1 2 3\n",
            "line 3: 3 expert ids, expected 2",
        ),
        (
            "prompt_id,layer,position,expert_ids\na,0,0,1 2\na,1,1,1 2\n",
            "no row for layer 1 at position 0",
        ),
        ("prompt_id,layer,position,expert_ids\na,0,0,1 2\nb,0,0,1 2\na,0,1,1 2\n", "appears twice"),
        ("prompt_id,layer,position,expert_ids\na,0,0,1 1\n", "lists an expert twice"),
        ("prompt_id,layer,position,expert_ids\na,0,0,1 9\n", "routes to expert 9"),
        (
            "prompt_id,layer,position,expert_ids,phase\na,0,0,1 2,decode\na,0,1,1 2,prefill\n",
            "prefill rows after decode",
        ),
    ],
)
def test_malformed_csv_names_the_problem(tmp_path, body, message):
    src = tmp_path / "bad.csv"
    src.write_text(body)
    cfg = ImportConfig(source="csv", path=src, out=tmp_path / "t", num_experts=8, progress=False)
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        import_trace(cfg)


def test_existing_trace_is_kept_unless_overwrite(tmp_path):
    src = write_csv(tmp_path / "r.csv", csv_rows(planted_routing(prompts=2)))
    cfg = ImportConfig(source="csv", path=src, out=tmp_path / "t", progress=False)
    import_trace(cfg)
    with pytest.raises(TraceError, match="--overwrite"):
        import_trace(cfg)
    import_trace(
        ImportConfig(source="csv", path=src, out=tmp_path / "t", overwrite=True, progress=False)
    )


def npy_base64(array_RAK: np.ndarray) -> str:
    """`choices[i].routed_experts` as vLLM's server sends it, written byte by byte from the
    documented format (docs/guide/import.md: base64 of the array's `.npy` bytes; uint8 ids when
    experts <= 256, else uint16), by neither numpy's writer nor ours. The `.npy` layout (numpy's
    NEP 1, version 1.0): the magic b"\\x93NUMPY", version bytes 1, 0, the header length as a
    little-endian uint16, the header (a Python dict literal of descr, fortran_order, shape,
    padded with spaces and ended by a newline so the data starts at a multiple of 64 bytes),
    then the values in C order."""
    descr, code = {"uint8": ("|u1", "B"), "uint16": ("<u2", "H")}[array_RAK.dtype.name]
    shape = ", ".join(str(n) for n in array_RAK.shape)
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({shape}), }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    assert (10 + len(header)) % 64 == 0
    values = [int(x) for x in array_RAK.reshape(-1).tolist()]
    data = struct.pack(f"<{len(values)}{code}", *values)
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + data
    return base64.b64encode(npy).decode("ascii")


def test_npy_base64_is_the_documented_layout_by_hand():
    """A uint8 [1, 1, 2] array [[[3, 200]]]: 10 bytes of preamble, a 118-byte header (the data
    starts at byte 128), then the 2 data bytes; a uint16 id is 2 little-endian bytes."""
    raw = base64.b64decode(npy_base64(np.array([[[3, 200]]], dtype=np.uint8)))
    header = "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 1, 2), }"
    assert raw[:10] == b"\x93NUMPY\x01\x00" + bytes([118, 0])
    assert raw[10:128] == (header + " " * (117 - len(header)) + "\n").encode()
    assert raw[128:] == bytes([3, 200])
    wide = base64.b64decode(npy_base64(np.array([[[300]]], dtype=np.uint16)))
    assert b"'descr': '<u2'" in wide and wide[128:] == bytes([44, 1])  # 300 = 1 * 256 + 44


def vllm_responses(routing, dense=(0,), prompt_start=0, dtype=np.uint8):
    """OpenAI completion responses as vLLM's server returns them with routed experts on: the
    layer axis counts every decoder layer, dense layers stay 0, rows = prompt + generated - 1."""
    out = []
    for pid, (ids, phase) in routing.items():
        T, L, K = ids.shape
        n_prompt = int((phase == 0).sum())
        n_gen = T - n_prompt + 1  # the last sampled token never ran a forward
        A = L + len(dense)
        full = np.zeros((T, A, K), dtype=dtype)
        full[:, [a for a in range(A) if a not in dense]] = ids
        out.append(
            {
                "id": pid,
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": "x",
                        "token_ids": list(range(100, 100 + n_gen)),
                        "routed_experts": npy_base64(full[prompt_start:]),
                    }
                ],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_gen,
                    "total_tokens": n_prompt + n_gen,
                },
                "prompt_token_ids": list(range(n_prompt)),
            }
        )
    return out


def test_vllm_jsonl_responses_drop_dense_layers_and_split_phases(tmp_path):
    routing = planted_routing(prompts=6, L=3, E=16, K=2)
    src = tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in vllm_responses(routing, dense=(0,))) + "\n")
    res = import_trace(ImportConfig(source="vllm", path=src, out=tmp_path / "t", progress=False))
    tr = assert_trace_equals(tmp_path / "t", routing)
    assert tr.spec.moe_layer_ids == (1, 2, 3) and tr.spec.num_decoder_layers == 4
    assert any("dense" in n for n in res.notes)
    rows = tr.load(("ids",))
    assert rows["token_ids_T"][:3].tolist() == [0, 1, 2]  # prompt tokens recorded


def test_vllm_prompt_start_offsets_positions_and_npz(tmp_path):
    routing = planted_routing(prompts=2, L=2, E=8, K=2, prefill=6, decode=3)
    resp = vllm_responses(routing, dense=(), prompt_start=2)
    (tmp_path / "a.json").write_text(json.dumps(resp))
    import_trace(
        ImportConfig(source="vllm", path=tmp_path / "a.json", out=tmp_path / "t", progress=False)
    )
    cut = {k: (v[0][2:], v[1][2:]) for k, v in routing.items()}
    assert_trace_equals(tmp_path / "t", cut, {k: list(range(2, 9)) for k in routing})
    d = tmp_path / "npz"
    d.mkdir()
    for pid, (ids, phase) in routing.items():
        n_prompt = int((phase == 0).sum())
        np.savez(
            d / f"{pid}.npz",
            routed_experts=ids.astype(np.uint8),
            prompt_token_ids=np.arange(n_prompt),
            token_ids=np.arange(ids.shape[0] - n_prompt + 1),
        )
    import_trace(ImportConfig(source="vllm", path=d, out=tmp_path / "t2", progress=False))
    assert_trace_equals(tmp_path / "t2", routing)


def test_vllm_uint16_ids_of_a_model_with_more_than_256_experts(tmp_path):
    routing = planted_routing(prompts=3, L=2, E=300, K=2)
    assert max(int(ids.max()) for ids, _ in routing.values()) > 255
    resp = vllm_responses(routing, dense=(1,), dtype=np.uint16)
    (tmp_path / "a.json").write_text(json.dumps(resp))
    src = tmp_path / "a.json"
    import_trace(ImportConfig(source="vllm", path=src, out=tmp_path / "t", progress=False))
    tr = assert_trace_equals(tmp_path / "t", routing)
    assert tr.spec.moe_layer_ids == (0, 2)


def test_vllm_without_routed_experts_says_how_to_enable_it(tmp_path):
    (tmp_path / "a.json").write_text(
        json.dumps(
            {"id": "x", "choices": [{"index": 0, "text": "y"}], "usage": {"prompt_tokens": 3}}
        )
    )
    with pytest.raises(TraceError, match="--enable-return-routed-experts"):
        import_trace(
            ImportConfig(
                source="vllm", path=tmp_path / "a.json", out=tmp_path / "t", progress=False
            )
        )


def sglang_dump(routing, path, L_dense=1, E=16, batch=3, rank=0, replicas=4):
    """A per_token dump as SGLang's recorder writes it: prompts prefilled one per EXTEND pass (as
    chunks of a pass with several), then decoded together in DECODE passes; physical ids with
    replicated experts; -1 in unused columns of the 8-wide buffer and in dense layers."""
    A = next(iter(routing.values()))[0].shape[1] + L_dense
    n_phys = E + replicas
    p2l = np.r_[np.arange(E), np.arange(replicas)]  # physical E+j is a replica of logical j
    p2l = np.tile(p2l, (A, 1))
    l2p = {j: E + j for j in range(replicas)}
    records, fp = [], 0
    items = list(routing.items())

    def rec(mode, toks, lens):
        nonlocal fp
        T = len(toks)
        buf = -np.ones((A, T, 8), dtype=np.int32)
        for t, (ids, row) in enumerate(toks):
            # odd (position + id): the replica's physical id, as EPLB would dispatch some tokens
            phys = [
                l2p.get(int(e), int(e)) if (row + int(e)) % 2 else int(e) for e in ids[row].flat
            ]
            phys = np.asarray(phys).reshape(ids[row].shape)
            buf[L_dense:, t, : ids.shape[2]] = phys
        r = {
            "forward_pass_id": fp,
            "rank": rank,
            "gatherer_key": "primary",
            "input_ids": [7] * T,
            "positions": [row for _, row in toks],
            "extend_seq_lens": lens,
            "forward_mode": mode,
            "topk_ids_of_layer": torch.from_numpy(buf),
            "misc_objects": [],
            "global_physical_count": torch.zeros(A, n_phys, dtype=torch.int32),
        }
        fp += 1
        records.append(r)

    for g in range(0, len(items), batch):
        group = items[g : g + batch]
        pre = [int((ph == 0).sum()) for _, (_, ph) in group]
        toks = [(ids, t) for (_, (ids, _)), n in zip(group, pre, strict=True) for t in range(n)]
        rec(1, toks, pre)  # one EXTEND pass with several sequences
        n_dec = [len(ph) - n for (_, (_, ph)), n in zip(group, pre, strict=True)]
        for s in range(max(n_dec)):
            live = [
                (ids, n + s) for (_, (ids, _)), n, d in zip(group, pre, n_dec, strict=True) if s < d
            ]
            rec(2, live, None)
    torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(p2l)}, path)


def test_sglang_per_token_dump_rebuilds_sequences_and_logical_ids(tmp_path):
    routing = planted_routing(prompts=7, L=3, E=16, K=2, prefill=4, decode=5)
    sglang_dump(routing, tmp_path / "expert_distribution_recorder_1.0_0.pt")
    res = import_trace(
        ImportConfig(source="sglang", path=tmp_path, out=tmp_path / "t", progress=False)
    )
    tr = Trace.open(tmp_path / "t")
    rows = tr.load(("ids",))
    got = {}
    for i, p in enumerate(tr.prompts):
        sel = rows["prompt_index_T"] == i
        got[p["id"]] = (rows["expert_ids_TLK"][sel].long().numpy(), rows["phase_T"][sel].numpy())

    # no request ids in the dump: sequences are matched by content
    def key(v):
        return (v[0].astype(np.int64).tobytes(), v[1].astype(np.int64).tobytes())

    assert sorted(map(key, got.values())) == sorted(map(key, routing.values()))
    assert tr.spec.moe_layer_ids == (1, 2, 3) and tr.spec.top_k == 2
    assert res.tokens == {"prefill": 7 * 4, "decode": 7 * 5}


def test_sglang_other_rank_and_non_dump_file(tmp_path):
    routing = planted_routing(prompts=2, L=2, E=8, K=2)
    sglang_dump(routing, tmp_path / "d_1.pt", E=8, rank=1)
    with pytest.raises(TraceError, match="no routing rows"):
        import_trace(
            ImportConfig(
                source="sglang", path=tmp_path / "d_1.pt", out=tmp_path / "t", progress=False
            )
        )
    import_trace(
        ImportConfig(
            source="sglang",
            path=tmp_path / "d_1.pt",
            out=tmp_path / "t",
            all_ranks=True,
            progress=False,
        )
    )
    torch.save({"x": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(TraceError, match="per_token dump"):
        import_trace(
            ImportConfig(
                source="sglang", path=tmp_path / "other.pt", out=tmp_path / "t3", progress=False
            )
        )


def test_trace_import_verb_writes_the_trace_the_api_writes(tmp_path):
    """`tensorbend trace import --from csv` (the CLI over import_trace): the same routing per
    prompt as the planted CSV, and a wrong path is one `error:` line with exit 2."""
    from tensorbend.cli import main

    routing = planted_routing(prompts=5, L=3, E=16, K=2)
    src = write_csv(tmp_path / "r.csv", csv_rows(routing))
    argv = ["trace", "import", "--source", "csv", str(src), "--out", str(tmp_path / "t"), "--quiet"]
    assert main(argv) == 0
    tr = Trace.open(tmp_path / "t")
    assert tr.info()["complete"] and tr.info()["num_moe_layers"] == 3
    assert main(["trace", "import", "--source", "csv", str(tmp_path / "nope.csv"), "--out",
                 str(tmp_path / "u"), "--quiet"]) == 2  # fmt: skip
