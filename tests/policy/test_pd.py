"""The PD request state machine by hand: every order of events, with the exact actions it returns."""

import pytest

from rayinfer.policy.pd import (
    Abort,
    AbortDecode,
    Backoff,
    BackoffElapsed,
    DecodeFailed,
    DecodeOutput,
    DecodePreempted,
    DeviceTransferBreaker,
    DropKV,
    Emit,
    Emitted,
    Fail,
    FailureKind,
    GrowDecode,
    KVTransportState,
    LookupStore,
    PDRequest,
    Phase,
    PrefillDone,
    PrefillFailed,
    ReleaseDecode,
    ReleasePrefill,
    ReportFailure,
    RunDecode,
    RunPrefill,
    Start,
    StoreLookupDone,
    Transfer,
    TransferDone,
    TransferFailed,
    UseObjectStore,
    backoff_s,
)

BS = 4
PROMPT = tuple(range(1, 11))  # 10 tokens: 2 full blocks may be stored
REPLICA, ERROR, REJECTED = FailureKind.REPLICA, FailureKind.ERROR, FailureKind.REJECTED


class Driver:
    """Feeds events to one request and keeps every action; carries out UseObjectStore as the shell does."""

    def __init__(self, max_retries: int = 5, rdt_ok: bool = True, transport: KVTransportState | None = None,
                 retry_deadline_s: float = 60.0):
        self.transport = transport or KVTransportState(rdt_ok)
        self.now = 0.0  # the fake clock, in seconds; tests move it
        self.req = PDRequest("r", list(PROMPT), BS, max_retries, self.transport, retry_deadline_s,
                             clock=lambda: self.now)
        self.actions = []

    def __call__(self, event):
        actions = self.req.handle(event)
        self.actions += actions
        if UseObjectStore() in actions:
            self.transport.rdt_ok = False
        return actions

    def to_decode(self, first: int = 11, used_rdt: bool = True):
        """Start -> store miss -> prefill samples ``first`` -> emitted -> transferred: now decoding."""
        self(Start())
        self(StoreLookupDone(0))
        self(PrefillDone((first,), "prefilled"))
        self(Emitted())
        self(TransferDone(used_rdt))
        assert self.req.phase is Phase.DECODE

    def check(self):
        """Invariants over the whole run: tickets taken and given back in turn, each token emitted once."""
        held = {"prefill": False, "decode": False}
        for a in self.actions:
            if isinstance(a, (RunPrefill, Transfer)):
                role = "prefill" if isinstance(a, RunPrefill) else "decode"
                assert not held[role], f"second {role} ticket taken"
                held[role] = True
            elif isinstance(a, (ReleasePrefill, ReleaseDecode)):
                role = "prefill" if isinstance(a, ReleasePrefill) else "decode"
                assert held[role], f"{role} ticket released twice"
                held[role] = False
        if self.req.is_finished:
            assert held == {"prefill": False, "decode": False}, held
        emitted = [t for a in self.actions if isinstance(a, Emit) for t in a.token_ids]
        assert emitted == self.req.output_token_ids
        assert sum(isinstance(a, Emit) and a.finished for a in self.actions) <= 1


def test_happy_path():
    d = Driver()
    assert d(Start()) == [LookupStore(PROMPT)]
    assert d(StoreLookupDone(0)) == [RunPrefill("r@0", (), 10, 0, "first")]
    assert d(PrefillDone((11,), "prefilled", num_cached_tokens=0)) == [ReleasePrefill(), Emit((11,))]
    assert d(Emitted()) == [Transfer(11, may_use_rdt=True)]
    assert d(TransferDone(used_rdt=True)) == [RunDecode((11,))]
    assert d(DecodeOutput((12,))) == [GrowDecode(1), Emit((12,))]
    assert d(Emitted()) == []
    assert d(DecodeOutput((13, 14))) == [GrowDecode(2), Emit((13, 14))]
    assert d(Emitted()) == []
    assert d(DecodeOutput((15,), True, "length")) == [GrowDecode(1), ReleaseDecode(), Emit((15,), True, "length")]
    assert d.req.is_finished and d.req.output_token_ids == [11, 12, 13, 14, 15]
    assert d.req.num_failures == 0 and d.req.num_legs == 1
    d.check()


def test_object_store_client_never_offers_rdt():
    d = Driver(rdt_ok=False)
    d(Start())
    d(StoreLookupDone(0))
    d(PrefillDone((11,), "prefilled"))
    assert d(Emitted()) == [Transfer(11, may_use_rdt=False)]


@pytest.mark.parametrize("reason,stop_reason", [("stop", 2), ("length", None)])
def test_engine_finishes_at_prefill_no_decode(reason, stop_reason):
    d = Driver()
    d(Start())
    d(StoreLookupDone(0))
    # no KV was exported: nothing to drop, no decode ticket ever taken
    assert d(PrefillDone((2,), reason, stop_reason)) == [ReleasePrefill(), Emit((2,), True, reason, stop_reason)]
    assert d.req.is_finished
    d.check()


def test_stop_string_in_the_first_token_drops_the_exported_kv():
    d = Driver()
    d(Start())
    d(StoreLookupDone(0))
    assert d(PrefillDone((11,), "prefilled", stop_string=" five")) == [
        ReleasePrefill(), DropKV(), Emit((11,), True, "stop", " five")]
    assert d.req.is_finished
    d.check()


def test_stop_string_mid_decode_aborts_the_decode_replica():
    d = Driver()
    d.to_decode()
    assert d(DecodeOutput((12,), stop_string="x")) == [
        GrowDecode(1), AbortDecode(), ReleaseDecode(), Emit((12,), True, "stop", "x")]
    d.check()


def test_engine_finish_wins_over_a_stop_string_except_length():
    d = Driver()
    d.to_decode()
    # the replica finished this request itself (EOS / stop token): no abort, its reason stands
    assert d(DecodeOutput((12,), True, "stop", stop_reason=2, stop_string="x")) == [
        GrowDecode(1), ReleaseDecode(), Emit((12,), True, "stop", 2)]
    # the budget's last token completed a stop string: "stop" with the string (OpenAI's and vLLM's rule)
    d = Driver()
    d.to_decode()
    assert d(DecodeOutput((12,), True, "length", stop_string="x")) == [
        GrowDecode(1), ReleaseDecode(), Emit((12,), True, "stop", "x")]


def test_engine_error_output_passes_through():
    d = Driver()
    d.to_decode()
    assert d(DecodeOutput((), True, "error", error="boom")) == [ReleaseDecode(), Emit((), True, "error", error="boom")]


def test_store_hit_credits_cached_tokens_and_first_leg_count_is_kept():
    d = Driver()
    d(Start())
    assert d(StoreLookupDone(2)) == [RunPrefill("r@0", (), 10, 8, "first")]
    d(PrefillDone((11,), "prefilled", num_cached_tokens=8))
    assert d.req.num_cached_tokens == 8
    d(Emitted())
    d(TransferDone(False))
    d(DecodeOutput((12,)))
    d(Emitted())
    d(DecodePreempted())
    d(StoreLookupDone(2))
    d(PrefillDone((13,), "prefilled", num_cached_tokens=12))  # the re-prefill loaded more
    assert d.req.num_cached_tokens == 8


def test_prefill_replica_failure_then_retry():
    d = Driver()
    d(Start())
    d(StoreLookupDone(0))
    assert d(PrefillFailed(REPLICA, "actor died")) == [
        ReportFailure("prefill"), ReleasePrefill(), Backoff(0.1, "actor died")]
    assert d.req.phase is Phase.BACKOFF
    assert d(BackoffElapsed()) == [LookupStore(PROMPT)]
    assert d(StoreLookupDone(1)) == [RunPrefill("r@1", (), 10, 4, "retry")]
    assert d(PrefillDone((11,), "prefilled")) == [ReleasePrefill(), Emit((11,))]
    assert d.req.num_failures == 1
    d.check()


def test_prefill_task_error_retries_without_reporting_the_replica():
    d = Driver()
    d(Start())
    d(StoreLookupDone(0))
    assert d(PrefillFailed(ERROR, "KeyError")) == [ReleasePrefill(), Backoff(0.1, "KeyError")]


def test_rejected_request_fails_at_once():
    d = Driver()
    d(Start())
    d(StoreLookupDone(0))
    assert d(PrefillFailed(REJECTED, "token ids out of range")) == [
        ReleasePrefill(), Fail("token ids out of range", rejected=True)]
    assert d.req.is_finished and d.req.num_failures == 0
    d.check()


def test_rejected_at_decode_aborts_there_and_fails():
    d = Driver()
    d.to_decode()
    assert d(DecodeFailed(REJECTED, "layout mismatch")) == [
        AbortDecode(), ReleaseDecode(), Fail("layout mismatch", rejected=True)]


def test_failed_rdt_transfer_switches_to_object_store_and_retries():
    shared = KVTransportState(True)
    d, other = Driver(transport=shared), Driver(transport=shared)
    d(Start())
    d(StoreLookupDone(0))
    d(PrefillDone((11,), "prefilled"))
    assert d(Emitted()) == [Transfer(11, may_use_rdt=True)]
    assert d(TransferFailed(REPLICA, "collective send failed", used_rdt=True)) == [
        ReportFailure("decode"), ReportFailure("prefill"), UseObjectStore(), ReleaseDecode(),
        Backoff(0.1, "collective send failed")]
    assert shared.rdt_ok is False
    # the retry re-prefills prompt + the token already out, and moves its KV through the object store
    assert d(BackoffElapsed()) == [LookupStore(PROMPT + (11,))]
    assert d(StoreLookupDone(0)) == [RunPrefill("r@1", (11,), 11, 0, "retry")]
    assert d(PrefillDone((12,), "prefilled")) == [ReleasePrefill(), Emit((12,))]
    assert d(Emitted()) == [Transfer(12, may_use_rdt=False)]
    assert d(TransferDone(False)) == [RunDecode((11, 12))]
    d(DecodeOutput((13,), True, "stop", 2))
    d.check()
    # the switch is client-wide: another request offers no RDT either
    other(Start())
    other(StoreLookupDone(0))
    other(PrefillDone((11,), "prefilled"))
    assert other(Emitted()) == [Transfer(11, may_use_rdt=False)]


def test_failed_object_store_transfer_keeps_rdt_setting():
    d = Driver(rdt_ok=False)
    d(Start())
    d(StoreLookupDone(0))
    d(PrefillDone((11,), "prefilled"))
    d(Emitted())
    assert d(TransferFailed(REPLICA, "decode actor died", used_rdt=False)) == [
        ReportFailure("decode"), ReportFailure("prefill"), ReleaseDecode(), Backoff(0.1, "decode actor died")]
    d2 = Driver()
    d2(Start())
    d2(StoreLookupDone(0))
    d2(PrefillDone((11,), "prefilled"))
    d2(Emitted())
    # not an actor failure: the decode replica may hold the request; abort it there
    assert d2(TransferFailed(ERROR, "KeyError", used_rdt=True)) == [AbortDecode(), ReleaseDecode(),
                                                                    Backoff(0.1, "KeyError")]
    assert d2.transport.rdt_ok


def test_decode_hand_back_re_prefills_outputs_so_far_and_is_not_a_failure():
    d = Driver()
    d.to_decode()
    d(DecodeOutput((12,)))
    d(Emitted())
    assert d(DecodePreempted()) == [ReleaseDecode(), LookupStore(PROMPT + (11, 12))]
    assert d(StoreLookupDone(3)) == [RunPrefill("r@1", (11, 12), 12, 12, "handback")]
    # the re-prefill's token is new: 11 and 12 are never emitted again
    assert d(PrefillDone((13,), "prefilled")) == [ReleasePrefill(), Emit((13,))]
    assert d(Emitted()) == [Transfer(13, True)]
    assert d(TransferDone(True)) == [RunDecode((11, 12, 13))]
    assert d(DecodeOutput((14,), True, "length")) == [GrowDecode(1), ReleaseDecode(), Emit((14,), True, "length")]
    assert d.req.output_token_ids == [11, 12, 13, 14]
    assert d.req.num_failures == 0 and d.req.num_legs == 2
    d.check()


def test_many_hand_backs_never_give_up():
    d = Driver(max_retries=0)
    d.to_decode()
    for i in range(5):
        d(DecodePreempted())
        d(StoreLookupDone(0))
        d(PrefillDone((20 + i,), "prefilled"))
        d(Emitted())
        d(TransferDone(True))
    d(DecodeOutput((30,), True, "stop", 2))
    assert d.req.output_token_ids == [11, 20, 21, 22, 23, 24, 30]
    d.check()


def test_decode_replica_failure_mid_stream():
    d = Driver()
    d.to_decode(used_rdt=True)
    d(DecodeOutput((12,)))
    d(Emitted())
    assert d(DecodeFailed(REPLICA, "decode actor died")) == [
        ReportFailure("decode"), ReportFailure("prefill"), UseObjectStore(), ReleaseDecode(),
        Backoff(0.1, "decode actor died")]
    assert d(BackoffElapsed()) == [LookupStore(PROMPT + (11, 12))]
    assert d(StoreLookupDone(0)) == [RunPrefill("r@1", (11, 12), 12, 0, "retry")]
    d(PrefillDone((13,), "prefilled"))
    assert d(Emitted()) == [Transfer(13, may_use_rdt=False)]
    d(TransferDone(False))
    d(DecodeOutput((14,), True, "length"))
    assert d.req.output_token_ids == [11, 12, 13, 14]
    d.check()


def test_a_dead_replica_leaves_per_transfer_device_moves_on():
    """cuda_ipc (no collective group): a replica that dies mid-transfer or mid-stream is reported and the
    request retried, but KV keeps moving by device for every request (no UseObjectStore)."""
    shared = KVTransportState(True, group=False)
    d = Driver(transport=shared)
    d(Start())
    d(StoreLookupDone(0))
    d(PrefillDone((11,), "prefilled"))
    assert d(Emitted()) == [Transfer(11, may_use_rdt=True)]
    assert d(TransferFailed(REPLICA, "prefill actor died", used_rdt=True)) == [
        ReportFailure("decode"), ReportFailure("prefill"), ReleaseDecode(), Backoff(0.1, "prefill actor died")]
    assert shared.rdt_ok
    d(BackoffElapsed())
    d(StoreLookupDone(0))
    d(PrefillDone((12,), "prefilled"))
    assert d(Emitted()) == [Transfer(12, may_use_rdt=True)]
    d(TransferDone(True))
    d(DecodeOutput((13,)))
    d(Emitted())
    assert UseObjectStore() not in d(DecodeFailed(REPLICA, "decode actor died"))
    assert shared.rdt_ok


def test_decode_task_error_mid_stream_aborts_and_retries():
    d = Driver()
    d.to_decode(used_rdt=False)
    d(DecodeOutput((12,)))
    d(Emitted())
    assert d(DecodeFailed(ERROR, "stream ended")) == [AbortDecode(), ReleaseDecode(), Backoff(0.1, "stream ended")]
    assert d.transport.rdt_ok


def test_errors_beyond_max_retries_fail_with_an_error_output():
    d = Driver(max_retries=2)
    d(Start())
    delays = []
    for _ in range(2):
        d(StoreLookupDone(0))
        *_, backoff = d(PrefillFailed(ERROR, "object lost"))
        assert isinstance(backoff, Backoff)
        delays.append(backoff.delay_s)
        d(BackoffElapsed())
    d(StoreLookupDone(0))
    assert d(PrefillFailed(ERROR, "object lost")) == [
        ReleasePrefill(), Fail("gave up after 3 failed attempts (3 errors; pd.max_retries=2): object lost")]
    assert delays == [0.1, 0.2] and d.req.is_finished
    d.check()


def test_replica_failures_wait_for_a_restart_until_the_deadline_not_a_count():
    """1P1D, the prefill replica restarting for ~40 s: every attempt meanwhile fails fast; the request
    keeps retrying (far more than max_retries) and finishes once the replica is back."""
    d = Driver(max_retries=2, retry_deadline_s=60.0)
    d.to_decode()
    d(DecodeFailed(REPLICA, "prefill actor died"))  # t = 0: the first failure starts the deadline
    num_attempts = 1
    while d.now < 40.0:
        *_, backoff = d.actions
        assert isinstance(backoff, Backoff) and backoff.delay_s <= 2.0
        d.now += backoff.delay_s
        d(BackoffElapsed())
        d(StoreLookupDone(0))
        d(PrefillFailed(REPLICA, "actor unavailable: restarting"))
        num_attempts += 1
    assert num_attempts > 2 * d.req.max_retries and d.req.phase is Phase.BACKOFF
    d.now += 2.0
    d(BackoffElapsed())
    d(StoreLookupDone(0))
    assert d(PrefillDone((12,), "prefilled")) == [ReleasePrefill(), Emit((12,))]
    d(Emitted())
    d(TransferDone(False))
    assert d(DecodeOutput((13,), finished=True, finish_reason="length"))[-1] == Emit((13,), True, "length")
    assert d.req.output_token_ids == [11, 12, 13]
    d.check()


def test_past_the_deadline_a_cut_answer_ends_with_an_error_never_a_stop():
    d = Driver(retry_deadline_s=3.0)
    d.to_decode()  # the first token is out
    d.now = 10.0
    d(DecodeFailed(REPLICA, "a"))
    d.now = 11.0
    d(BackoffElapsed())
    d(StoreLookupDone(0))
    d(PrefillDone((12,), "prefilled"))
    d(Emitted())
    d.now = 12.875
    # the last backoff only waits for what is left of the deadline (0.125 s, not backoff_s(2) = 0.2)
    assert d(TransferFailed(REPLICA, "b", used_rdt=False))[-1] == Backoff(0.125, "b")
    d.now = 13.0
    d(BackoffElapsed())
    d(StoreLookupDone(0))
    assert d(PrefillFailed(REPLICA, "c")) == [
        ReportFailure("prefill"), ReleasePrefill(),
        Fail("gave up after 3 failed attempts in 3.0 s (pd.retry_deadline_s=3): c")]
    assert d.req.output_token_ids == [11, 12] and d.req.is_finished
    assert not any(isinstance(a, Emit) and a.finished for a in d.actions)  # no normal finish went out
    d.check()


def test_backoff_doubles_up_to_two_seconds():
    assert [backoff_s(n) for n in range(1, 8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]


@pytest.mark.parametrize("steps,cleanups", [
    ([], []),
    ([Start()], []),  # waiting on the store
    ([Start(), StoreLookupDone(0)], [ReleasePrefill()]),  # prefill running
    ([Start(), StoreLookupDone(0), PrefillDone((11,), "prefilled")], [DropKV()]),  # left at the first token
    ([Start(), StoreLookupDone(0), PrefillDone((11,), "prefilled"), Emitted()],
     [AbortDecode(), ReleaseDecode()]),  # transfer in flight
    ([Start(), StoreLookupDone(0), PrefillDone((11,), "prefilled"), Emitted(), TransferDone(True),
      DecodeOutput((12,))], [AbortDecode(), ReleaseDecode()]),  # left while decoding
    ([Start(), StoreLookupDone(0), PrefillFailed(REPLICA, "x")], []),  # backing off
    ([Start(), StoreLookupDone(0), PrefillDone((2,), "stop")], []),  # already finished
])
def test_abort_cleans_up_once_per_phase(steps, cleanups):
    d = Driver()
    for e in steps:
        d(e)
    assert d(Abort()) == cleanups
    assert d.req.is_finished
    assert d(Abort()) == []  # a second abort cleans nothing twice
    d.check()


def test_events_out_of_order_are_a_bug():
    d = Driver()
    with pytest.raises(RuntimeError, match="PrefillDone in phase new"):
        d(PrefillDone((1,), "prefilled"))
    d.to_decode()
    with pytest.raises(RuntimeError, match="TransferDone in phase decode"):
        d(TransferDone(True))
    d(Abort())
    with pytest.raises(RuntimeError, match="DecodeOutput in phase done"):
        d(DecodeOutput((1,)))


def test_every_replica_of_a_role_gone_fails_at_once_as_an_error():
    """The router found every prefill (or decode) replica dead for good: no retry, however long the deadline;
    an error output (not a rejection of the request)."""
    gone = FailureKind.UNAVAILABLE
    d = Driver(retry_deadline_s=600.0)
    d(Start())
    d(StoreLookupDone(0))
    assert d(PrefillFailed(gone, "every prefill replica is dead")) == [
        ReleasePrefill(), Fail("every prefill replica is dead")]
    assert d.req.is_finished and not any(isinstance(a, Backoff) for a in d.actions)
    d.check()

    d = Driver(retry_deadline_s=600.0)
    d(Start())
    d(StoreLookupDone(0))
    d(PrefillDone((11,), "prefilled"))
    d(Emitted())
    assert d(TransferFailed(gone, "every decode replica is dead", False)) == [
        AbortDecode(), ReleaseDecode(), Fail("every decode replica is dead")]
    assert d.req.is_finished
    d.check()



def test_a_cuda_ipc_breaker_waits_then_lets_one_trial_through(clock):
    """Closed: every transfer by device. A transport failure opens it for retry_s; then exactly one trial goes
    by device while the rest take the object store; the trial's success closes it."""
    b = DeviceTransferBreaker(enabled=True, recoverable=True, retry_s=30.0, clock=clock)
    assert b.closed and b.allow() and b.allow()
    assert b.failed() == 30.0
    assert not b.closed and not b.allow()
    clock.now += 29.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow() and b.num_trials == 1  # the trial
    assert not b.allow() and not b.allow()  # one at a time: the others use the object store
    assert b.succeeded() and b.closed and b.allow()
    assert not b.succeeded()  # already closed: nothing to report


def test_failed_trials_double_the_wait_up_to_the_cap_and_a_success_resets_it(clock):
    b = DeviceTransferBreaker(enabled=True, recoverable=True, retry_s=30.0, max_retry_s=100.0, clock=clock)
    waits = []
    waits.append(b.failed())
    for _ in range(3):
        clock.now += waits[-1]
        assert b.allow()  # a trial...
        waits.append(b.failed())  # ...that fails
    assert waits == [30.0, 60.0, 100.0, 100.0]
    clock.now += 100.0
    assert b.allow() and b.succeeded()
    assert b.failed() == 30.0  # a new run of failures starts from retry_s again


def test_transfers_in_flight_when_the_breaker_opened_do_not_lengthen_the_wait(clock):
    b = DeviceTransferBreaker(enabled=True, recoverable=True, retry_s=30.0, clock=clock)
    assert b.failed() == 30.0
    clock.now += 10.0
    assert b.failed() == 20.0 and b.failed() == 20.0  # stragglers: the same trial time
    assert b.num_failures == 1
    clock.now += 20.0
    assert b.allow()


def test_a_trial_that_never_reports_frees_its_place_after_the_timeout(clock):
    b = DeviceTransferBreaker(enabled=True, recoverable=True, retry_s=30.0, trial_timeout_s=60.0, clock=clock)
    b.failed()
    clock.now += 30.0
    assert b.allow() and not b.allow()
    clock.now += 59.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow() and b.num_trials == 2  # the first trial's request took another way (or died)


def test_a_group_breaker_and_a_zero_retry_stay_open_for_good(clock):
    for b in (DeviceTransferBreaker(enabled=True, recoverable=False, clock=clock),  # nccl / gloo
              DeviceTransferBreaker(enabled=True, recoverable=True, retry_s=0.0, clock=clock)):  # cuda_ipc, off
        assert b.allow()
        assert b.failed() is None and b.failed() is None
        clock.now += 1e6
        assert not b.allow() and not b.closed
    off = DeviceTransferBreaker(enabled=False, recoverable=True, clock=clock)  # the object store fleet
    assert not off.allow() and not off.closed and not off.succeeded()
