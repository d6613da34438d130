"""The soak (bench/soak/soak.py): a multi-turn workload's KV blocks through a real gdkvd on the
local store, the daemon SIGKILLed and SIGTERMed and restarted, the store reclaiming segments and
the host cache evicting. Every value read is checked against its key (into a buffer poisoned
before the read); a value gdkvd acknowledged that is gone without gdkvd having reported its
removal on /removed is lost; gdkvd's private RSS must not grow (least-squares slope over each life
after warm-up), nor its descriptors, memfds and memfd mappings, nor the client's; no request may
fail. The scripts/test run, then the same run with a leak injected into gdkvd and a run with a
store rolled back under gdkvd, which must fail; and the checks' judgement on made-up cases. The
30-minute run is the same program (docs/benchmarks.md, "Soak")."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "soak"))
import soak  # noqa: E402
from ledger import GRACE_S, Ledger  # noqa: E402

MiB = 1 << 20
# scripts/test's run: three kills (SIGKILL, SIGTERM, SIGKILL), four lives, the first three judged
# from 20 s to 50 s (the last one is too short).
RUN = ["--seconds", "175", "--restart-every", "50", "--warmup", "20"]
LIMIT = 0.25   # soak.py's --rss-slope-limit default, MiB/s


def soak_run(*args: str, timeout: int = 400) -> tuple[int, str, dict]:
    out = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "soak" / "soak.py"), *args,
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=timeout)
    text = out.stdout.decode(errors="replace")
    # The report without its last line (the JSON of every sample), which would hide what failed.
    report = "\n".join(line for line in text.splitlines() if not line.startswith("{"))[-4000:]
    return out.returncode, report, json.loads(text.strip().splitlines()[-1])


def test_three_minute_soak_with_restarts_is_flat_and_loses_nothing():
    rc, report, r = soak_run(*RUN)
    assert rc == 0, report
    assert r["failures"] == [], report
    assert r["wrong"] == 0 and r["failed"] == 0 and r["lost"] == 0
    assert r["lives"] >= 4          # started, then killed and restarted three times
    assert r["retried"] > 0         # requests really met a dead daemon and came back
    assert r["blocks_loaded"] > 0 and r["blocks_stored"] > 0
    assert r["reclaimed"] > 0 and r["evictions"] > 0
    # Each restart checked the values held at the kill against what the store listed after it.
    assert len(r["restarts"]) >= 3 and all(c["expected"] > 100 for c in r["restarts"]), report
    assert len(r["rss_slopes"]) >= 3, report
    assert len(r["samples"]) >= 60


def test_the_three_minute_soak_fails_on_a_leak_of_half_a_mib_per_second_in_gdkvd():
    # GDKVD_TEST_LEAK_BYTES_PER_S: gdkvd allocates and writes 0.5 MiB a second and never frees
    # it. The run stops at its first failure: the end of life 0, judged on its RSS slope.
    rc, report, r = soak_run(*RUN, "--test-leak-bytes-per-s", str(MiB // 2), "--stop-on-failure")
    assert rc == 1, report
    assert r["failures"] and all("private RSS grew" in f for f in r["failures"]), report
    assert r["rss_slopes"]["0"] > LIMIT, report
    assert r["lost"] == 0 and r["wrong"] == 0


def test_a_store_that_lost_acknowledged_writes_fails_the_soak():
    # At the second kill the store file is put back as it was at the first: every value
    # acknowledged in between is gone, and gdkvd reports no removal of them.
    rc, report, r = soak_run("--seconds", "60", "--restart-every", "4", "--warmup", "2",
                             "--test-roll-back-store", "--stop-on-failure")
    assert rc == 1, report
    assert r["lost"] > 100, report
    # The first restart loses nothing (values the store reclaimed after the feed's last read
    # before the kill are "unknown", not lost: a reclaimed segment's keys stay gone at reopen).
    assert r["restarts"][0]["lost"] == 0, report
    assert "values lost" in r["failures"][0], report
    assert r["wrong"] == 0


# ---- the checks on made-up cases -----------------------------------------------------------------
def test_a_read_that_writes_nothing_or_another_keys_value_fails_the_value_check():
    a, b = bytes(range(32)), bytes(range(1, 33))
    out = np.empty(1000, np.uint8)
    soak.poison(out, a)
    assert not soak.matches(out, a)   # the read wrote nothing: the poison is still there
    out[:] = soak.value_of(a, out.size)
    assert soak.matches(out, a)
    out[:500] = soak.value_of(b, out.size)[:500]
    assert not soak.matches(out, a)   # half written
    soak.poison(out, b)
    assert not soak.matches(out, a) and not soak.matches(out, b)
    out[:] = soak.value_of(b, out.size)
    assert not soak.matches(out, a)   # a stale buffer of another key's value


def key(i: int) -> bytes:
    return b"soak-key-%06d" % i


def store(ledger: Ledger, keys: list[bytes], t: float) -> None:
    ledger.sending(keys, len(keys), t)
    ledger.stored(keys, len(keys), t, t + 0.01)


def read(ledger: Ledger, t: float, *removed: bytes) -> None:
    ledger.reading(t)
    ledger.removed(list(removed))


def test_a_value_missing_in_a_life_is_lost_unless_gdkvd_reported_it():
    ledger = Ledger(segment_bytes=8, value_bytes=1)
    store(ledger, [key(0), key(1), key(2)], 1.0)
    read(ledger, 2.0)
    ledger.missing(key(0), 3.0)
    ledger.missing(key(1), 3.0)
    ledger.missing(key(9), 3.0)         # never stored: not judged
    read(ledger, 3.0 + GRACE_S / 2, key(0))
    assert ledger.explained == 1 and ledger.lost == []   # key 1 may still be reported
    read(ledger, 3.0 + GRACE_S * 2)
    assert [k for k, _ in ledger.lost] == [key(1)]
    # Reported before the user found it missing: nothing to explain, nothing lost.
    read(ledger, 5.0, key(2))
    ledger.missing(key(2), 5.5)
    read(ledger, 7.0)
    assert ledger.explained == 1 and len(ledger.lost) == 1


def test_a_report_that_may_precede_a_new_store_leaves_the_key_unjudged():
    ledger = Ledger(segment_bytes=8, value_bytes=1)
    store(ledger, [key(0)], 1.0)
    read(ledger, 2.0)
    store(ledger, [key(0)], 2.5)        # stored again after that read began
    read(ledger, 3.0, key(0))           # removed: the old Store's, or the new one's
    assert ledger.entries[key(0)].held is None
    ledger.missing(key(0), 4.0)
    read(ledger, 6.0)
    assert ledger.lost == []
    store(ledger, [key(1)], 6.5)
    read(ledger, 7.0)
    read(ledger, 8.0, key(1))           # acknowledged before the previous read: the one removed
    assert key(1) not in ledger.entries


def test_a_restart_tells_lost_values_from_values_reclaimed_before_the_kill():
    # Segments of 4 values: a value missing after the restart whose Store was sent after an
    # older value's acknowledgement, while that older value is still listed, was not reclaimed.
    ledger = Ledger(segment_bytes=4, value_bytes=1)
    for i in range(8):
        store(ledger, [key(i)], float(i))
    read(ledger, 10.0)
    ledger.missing(key(5), 10.2)          # found after the last read: unknown
    listed = {key(i) for i in (0, 1, 2, 3, 4, 6, 7)}
    check = ledger.restarted(0, listed, 11.0)
    assert check.expected == 7          # key 5 was found missing: no longer expected
    assert check.lost == [] and check.unknown == []
    assert ledger.unknown == 1 and ledger.lost == []
    # The oldest values gone (reclaimed after the last read), and one of the newest: lost.
    store(ledger, [key(8), key(9)], 12.0)
    read(ledger, 13.0)
    listed = {key(i) for i in (2, 3, 4, 6, 8)}
    check = ledger.restarted(1, listed, 14.0)
    assert sorted(check.unknown) == [key(0), key(1)]
    assert check.lost == [key(7), key(9)]
    assert [k for k, _ in ledger.lost] == [key(7), key(9)]
    # A value written again since its acknowledged Store (no answer: the kill) is no witness:
    # the record listed may be the newer one.
    ledger = Ledger(segment_bytes=4, value_bytes=1)
    store(ledger, [key(0), key(1)], 1.0)
    ledger.sending([key(0)], 1, 2.0)
    ledger.unanswered(1)
    read(ledger, 3.0)
    check = ledger.restarted(0, {key(0)}, 4.0)
    assert check.lost == [] and check.unknown == [key(1)]


def test_more_values_gone_at_a_restart_than_the_store_could_reclaim_are_lost():
    ledger = Ledger(segment_bytes=4, value_bytes=1)   # at most 2 segments = 8 values
    store(ledger, [key(i) for i in range(20)], 1.0)
    read(ledger, 2.0)
    check = ledger.restarted(0, set(), 3.0)
    assert len(check.unknown) == 20 and check.unknown_allowed == 8
    assert len(ledger.lost) == 20
    # Bytes sent after the last read widen the gap by the segments they could have filled.
    ledger = Ledger(segment_bytes=4, value_bytes=1)
    store(ledger, [key(i) for i in range(10)], 1.0)
    read(ledger, 2.0)
    ledger.sending([key(10)], 8, 2.5)
    check = ledger.restarted(0, {key(10)}, 3.0)
    assert check.unknown_allowed == 16 and len(check.unknown) == 10 and ledger.lost == []
