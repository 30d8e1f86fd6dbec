# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The CPU benchmark's context-parallel rows (``--cp 2``) at a tiny shape.

Only what repeats to the byte is checked: the bytes and calls each rank
communicates per step against their formulas, and the memory the K/V store and
the k = 1 stand-in for 1F1B hold.
"""

import json

import pytest

import benchmarks.cpu_bench as bench

CP, PP, M, SEQ_LEN, DIM, LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 2, 32, 32, 2, 1, 16
FP32 = 4


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "cp.json"
    argv = [
        "--cp", str(CP), "--pp", str(PP), "-m", str(M), "-k", "1", "4", "--steps", "1",
        "--warmup-steps", "0", "--dim", str(DIM), "--layers", str(LAYERS), "--heads", "2",
        "--kv-heads", str(KV_HEADS), "--ffn-dim", "64", "--vocab", "64",
        "--seq-len", str(SEQ_LEN), "--json", str(path),
    ]
    assert bench.main(argv) == 0
    return json.loads(path.read_text())


def _row(records, schedule, segments=1, cp=1):
    return next(
        r for r in records
        if (r["schedule"], r["segments"], r["cp"]) == (schedule, segments, cp)
    )


def test_rows_are_1f1b_and_seq1f1b_with_and_without_cp(records):
    assert [(r["schedule"], r["segments"], r["cp"]) for r in records] == [
        ("1F1B", 1, 1), ("Seq1F1B", 1, 1), ("Seq1F1B", 4, 1), ("Seq1F1B", 1, CP),
        ("Seq1F1B", 4, CP),
    ]
    for record in records:
        ranks = PP * record["cp"]
        assert len(record["traffic_bytes"]) == len(record["peak_activation_bytes"]) == ranks


def test_every_rank_communicates_what_the_formulas_say(records):
    """Per layer and microbatch, summed over segments: (c-1)/c of the sequence's K and V
    all-gathered forward and as much reduce-scattered backward, one collective per segment
    each way; per microbatch, the stage's [seq_len / c, dim] output sent and its gradient
    received (on the last stage, the other way round), one tensor per segment."""
    layers_per_stage = LAYERS // PP
    for record in records:
        c, k = record["cp"], record["segments"]
        kv_bytes = layers_per_stage * M * (c - 1) * 2 * SEQ_LEN * KV_HEADS * HEAD_DIM * FP32 // c
        hand_off_bytes = M * SEQ_LEN // c * DIM * FP32
        expected_bytes = {
            "all_gather": kv_bytes, "reduce_scatter": kv_bytes,
            "pp_send": hand_off_bytes, "pp_recv": hand_off_bytes,
        }
        collectives = layers_per_stage * M * k if c > 1 else 0
        expected_calls = {
            "all_gather": collectives, "reduce_scatter": collectives, "pp_send": M * k,
            "pp_recv": M * k,
        }
        for traffic, calls in zip(record["traffic_bytes"], record["traffic_calls"]):
            assert traffic == expected_bytes, record["label"]
            assert calls == expected_calls, record["label"]


def test_k1_stands_in_for_1f1b_where_both_run(records):
    """Without CP, Seq1F1B k = 1 holds and sends on every rank what torch's 1F1B does."""
    torch_1f1b, k1 = _row(records, "1F1B"), _row(records, "Seq1F1B")
    assert k1["peak_activation_bytes"] == torch_1f1b["peak_activation_bytes"]
    assert k1["traffic_bytes"] == torch_1f1b["traffic_bytes"]


@pytest.mark.parametrize("segments", [1, 4])
def test_cp_divides_saved_activations_and_not_the_kv_store(records, segments):
    """Every CP rank's store holds the gathered K/V its pipeline rank held without CP."""
    alone, shared = _row(records, "Seq1F1B", segments), _row(records, "Seq1F1B", segments, CP)
    for rank, kv_bytes in enumerate(shared["peak_kv_store_bytes"]):
        assert kv_bytes == alone["peak_kv_store_bytes"][rank // CP] > 0
    assert shared["peak_saved_tensor_bytes"][0] < alone["peak_saved_tensor_bytes"][0]
