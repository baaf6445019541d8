package sink

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// The ack watcher's transitions, without a server: the acks come from the
// test, the stream's messages from fakeStream, the watermark bucket from
// failingKV.

const watcherSource = "7300000000000000001/1/app/jetbox"

// fakeStream serves GetMsg from msgs (ErrMsgNotFound for the rest).
type fakeStream struct {
	jetstream.Stream
	msgs map[uint64]*jetstream.RawStreamMsg
}

func (f fakeStream) GetMsg(_ context.Context, seq uint64, _ ...jetstream.GetMsgOpt) (*jetstream.RawStreamMsg, error) {
	if m, ok := f.msgs[seq]; ok {
		return m, nil
	}
	return nil, jetstream.ErrMsgNotFound
}

// failingKV refuses every Put.
type failingKV struct{ jetstream.KeyValue }

func (failingKV) Put(context.Context, string, []byte) (uint64, error) {
	return 0, errors.New("bucket unavailable")
}

// watcherFixture is an ack watcher of a session of a publisher in mode d
// that has no connection, and the outcomes its done callbacks reported.
type watcherFixture struct {
	t      *testing.T
	p      *Publisher
	w      *ackWatcher
	stream fakeStream
	done   map[string][]error // per event id, every done call
}

func newWatcherFixture(t *testing.T, d Delivery) *watcherFixture {
	p := &Publisher{cfg: Config{Stream: "OUTBOX", SubjectPrefix: "outbox", Delivery: d, PublishTimeout: time.Second, Metrics: metrics.New()},
		nc: &nats.Conn{}, log: zerolog.Nop()}
	p.replays = replays{source: watcherSource, claims: map[uint64]format.Position{}}
	f := &watcherFixture{t: t, p: p, stream: fakeStream{msgs: map[uint64]*jetstream.RawStreamMsg{}}, done: map[string][]error{}}
	s := &Session{p: p, source: watcherSource, ctx: context.Background(), pending: make(chan pendingAck, 8)}
	s.cur = cursor{stream: f.stream, seq: 10}
	f.w = &ackWatcher{s: s}
	return f
}

// pa is the guarded publish of id at (lsn, 0), expecting the stream's last
// sequence to be expect.
func (f *watcherFixture) pa(id string, lsn uint64, expect uint64) pendingAck {
	return pendingAck{guarded: true, expect: expect, id: id, subject: "outbox.order.E", pos: format.Position{CommitLSN: lsn},
		committed: time.Now(), done: func(err error) { f.done[id] = append(f.done[id], err) }}
}

// storedAt puts the message of event id at (lsn, 0) into the stream at seq.
func (f *watcherFixture) storedAt(seq uint64, id string, lsn uint64) {
	ev := &decoder.Event{ID: id, AggregateType: "order", AggregateID: "1", EventType: "E", CommitLSN: pglogrepl.LSN(lsn), Origin: watcherSource}
	f.stream.msgs[seq] = &jetstream.RawStreamMsg{Subject: "outbox.order.E", Sequence: seq, Header: f.p.header(ev, &txText{}, 0)}
}

// outcomeOf is the serial outcome the watcher reported (it reports before
// resolve returns).
func outcomeOf(t *testing.T, serial chan serialResult) serialResult {
	t.Helper()
	select {
	case r := <-serial:
		return r
	default:
		t.Fatal("no serial outcome reported")
		return serialResult{}
	}
}

func ack(seq uint64, dup bool) *jetstream.PubAck {
	return &jetstream.PubAck{Stream: "OUTBOX", Sequence: seq, Duplicate: dup}
}

// wantDone checks id's done ran once, with an error or not.
func (f *watcherFixture) wantDone(id string, failed bool) {
	f.t.Helper()
	got := f.done[id]
	if len(got) != 1 || (got[0] != nil) != failed {
		f.t.Fatalf("done(%s) calls %v, want one with failed=%v", id, got, failed)
	}
}

func (f *watcherFixture) wantAcked(seq uint64) {
	f.t.Helper()
	if got := f.p.ackedSeq.Load(); got != seq {
		f.t.Fatalf("ackedSeq %d, want %d", got, seq)
	}
}

// TestAckWatcherInOrder: stored acks wait for the flush, which moves the
// watermark over them before their done calls; each raises ackedSeq.
func TestAckWatcherInOrder(t *testing.T) {
	f := newWatcherFixture(t, DedupGuarded)
	for i, id := range []string{"a", "b", "c"} {
		f.w.resolve(f.pa(id, 0x100+uint64(i), 10+uint64(i)), ack(11+uint64(i), false), nil)
	}
	if len(f.done) != 0 || len(f.w.ready) != 3 {
		t.Fatalf("done before the flush: %v, %d ready", f.done, len(f.w.ready))
	}
	f.wantAcked(13)
	f.w.flush()
	for _, id := range []string{"a", "b", "c"} {
		f.wantDone(id, false)
	}
	if wm := f.p.replays.wm; !f.p.replays.hasWM || wm.Seq != 13 || wm.CommitLSN != 0x102 {
		t.Fatalf("watermark %+v, want seq 13 at 0x102", wm)
	}
	if f.w.broken || f.w.frozen || f.p.Stats().Published != 3 {
		t.Fatalf("broken %v, frozen %v, stats %+v", f.w.broken, f.w.frozen, f.p.Stats())
	}
}

// TestAckWatcherFailureBreaksAndFreezes: a failed publish lets the events
// resolved before it go first, then fails; later stored acks neither raise
// ackedSeq nor move the watermark.
func TestAckWatcherFailureBreaksAndFreezes(t *testing.T) {
	f := newWatcherFixture(t, DedupGuarded)
	f.w.resolve(f.pa("a", 0x100, 10), ack(11, false), nil)
	f.w.resolve(f.pa("b", 0x101, 11), nil, errors.New("timeout"))
	f.wantDone("a", false)
	f.wantDone("b", true)
	if !f.w.broken || !f.w.frozen {
		t.Fatalf("after a failure: broken %v, frozen %v", f.w.broken, f.w.frozen)
	}
	f.w.resolve(f.pa("c", 0x102, 12), ack(12, false), nil)
	f.w.flush()
	f.wantDone("c", false)
	f.wantAcked(11)
	if wm := f.p.replays.wm; wm.Seq != 11 || wm.CommitLSN != 0x100 {
		t.Fatalf("watermark %+v moved past the failure", wm)
	}
	if st := f.p.Stats(); st.Errors != 1 || st.Published != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// TestAckWatcherForeignStreamFails: an ack from another stream fails the
// event and breaks the pipeline.
func TestAckWatcherForeignStreamFails(t *testing.T) {
	f := newWatcherFixture(t, ExactlyOnce)
	f.w.resolve(f.pa("a", 0x100, 10), &jetstream.PubAck{Stream: "OTHER", Sequence: 11}, nil)
	f.wantDone("a", true)
	f.wantAcked(0)
	if !f.w.broken || !f.w.frozen {
		t.Fatalf("broken %v, frozen %v", f.w.broken, f.w.frozen)
	}
}

// TestAckWatcherDuplicates: a guarded publish acked as a Duplicate of this
// very row at the sequence it expected keeps the pipeline in order; the
// very row elsewhere breaks it; another row's message is a repeated id.
func TestAckWatcherDuplicates(t *testing.T) {
	t.Run("the row at the expected sequence", func(t *testing.T) {
		f := newWatcherFixture(t, ExactlyOnce)
		f.storedAt(11, "a", 0x100)
		f.w.resolve(f.pa("a", 0x100, 10), ack(11, true), nil)
		f.w.flush()
		f.wantDone("a", false)
		f.wantAcked(11)
		if f.w.broken || f.p.Stats().Duplicates != 1 {
			t.Fatalf("broken %v, stats %+v", f.w.broken, f.p.Stats())
		}
	})
	t.Run("the row elsewhere", func(t *testing.T) {
		f := newWatcherFixture(t, ExactlyOnce)
		f.storedAt(9, "a", 0x100)
		f.w.resolve(f.pa("a", 0x100, 10), ack(9, true), nil)
		f.w.resolve(f.pa("b", 0x101, 11), ack(12, false), nil)
		f.w.flush()
		f.wantDone("a", false)
		f.wantDone("b", false)
		f.wantAcked(0)
		if !f.w.broken || f.w.frozen {
			t.Fatalf("broken %v, frozen %v: want broken only", f.w.broken, f.w.frozen)
		}
	})
	t.Run("another row's id", func(t *testing.T) {
		f := newWatcherFixture(t, ExactlyOnce)
		f.storedAt(11, "a", 0x0ff)
		f.w.resolve(f.pa("a", 0x100, 10), ack(11, true), nil)
		f.wantDone("a", true)
		var ie *decoder.InvalidEventError
		if !errors.As(f.done["a"][0], &ie) || ie.Code != format.ReasonDuplicateID {
			t.Fatalf("done(a) = %v, want a repeated id", f.done["a"][0])
		}
		if !f.w.broken || !f.w.frozen {
			t.Fatalf("broken %v, frozen %v", f.w.broken, f.w.frozen)
		}
	})
}

// TestAckWatcherWatermarkStoreFails: when the watermark cannot be stored,
// the events it was to cover get the error (a serial Publish too) and it
// stays frozen: later events are confirmed without moving it.
func TestAckWatcherWatermarkStoreFails(t *testing.T) {
	f := newWatcherFixture(t, DedupGuarded)
	f.p.replays.kv = failingKV{}
	serial := make(chan serialResult, 1)
	pa := f.pa("a", 0x100, 10)
	pa.serial, pa.guarded = serial, false
	f.w.resolve(pa, ack(11, false), nil) // a serial publish: flushed at once
	f.wantDone("a", true)
	if r := outcomeOf(t, serial); r.err == nil {
		t.Fatalf("serial outcome %+v, want the watermark's error", r)
	}
	if !f.w.frozen || f.w.broken {
		t.Fatalf("frozen %v, broken %v: want frozen only", f.w.frozen, f.w.broken)
	}
	f.w.resolve(f.pa("b", 0x101, 11), ack(12, false), nil)
	f.w.flush()
	f.wantDone("b", false)
	if f.p.replays.hasWM {
		t.Fatalf("watermark %+v moved while frozen", f.p.replays.wm)
	}
}

// TestAckWatcherSerialOutcome: a serial publish is flushed at once and its
// outcome reported: stored as new, or a duplicate (stored false).
func TestAckWatcherSerialOutcome(t *testing.T) {
	f := newWatcherFixture(t, DedupGuarded)
	f.storedAt(5, "a", 0x100)
	serial := make(chan serialResult, 1)
	pa := f.pa("a", 0x100, 0)
	pa.serial, pa.guarded = serial, false
	f.w.resolve(pa, ack(5, true), nil)
	if r := outcomeOf(t, serial); r.err != nil || r.stored {
		t.Fatalf("duplicate: outcome %+v, want not stored", r)
	}
	pb := f.pa("b", 0x101, 0)
	pb.serial, pb.guarded = serial, false
	f.w.resolve(pb, ack(11, false), nil)
	if r := outcomeOf(t, serial); r.err != nil || !r.stored || r.seq != 11 {
		t.Fatalf("stored: outcome %+v, want stored at 11", r)
	}
	f.wantDone("a", false)
	f.wantDone("b", false)
}

// TestAckWatcherAbandon: an abandoned session calls no done, for the
// resolved events, the one awaited or those still pending.
func TestAckWatcherAbandon(t *testing.T) {
	f := newWatcherFixture(t, DedupGuarded)
	f.w.resolve(f.pa("a", 0x100, 10), ack(11, false), nil)
	f.w.s.pending <- f.pa("c", 0x102, 12)
	close(f.w.s.pending)
	f.w.abandon(f.pa("b", 0x101, 11))
	f.w.flush()
	if len(f.done) != 0 || len(f.w.s.pending) != 0 {
		t.Fatalf("done calls %v, %d still pending", f.done, len(f.w.s.pending))
	}
}

// TestSerialReplay: the serial replay waits for each outcome, ends at the
// first event stored as new, and refuses everything after a failure.
func TestSerialReplay(t *testing.T) {
	var r serialReplay
	quit := make(chan struct{})
	if stored, _, err := r.await(quit); stored || err != nil {
		t.Fatalf("nothing in flight: stored %v, err %v", stored, err)
	}
	outcome := func(res serialResult) {
		ch := make(chan serialResult, 1)
		ch <- res
		r.sent(ch)
	}
	outcome(serialResult{seq: 4}) // a duplicate
	if stored, _, err := r.await(quit); stored || err != nil {
		t.Fatalf("after a duplicate: stored %v, err %v", stored, err)
	}
	outcome(serialResult{stored: true, seq: 5})
	if stored, seq, err := r.await(quit); !stored || seq != 5 || err != nil {
		t.Fatalf("after a store: stored %v at %d, err %v", stored, seq, err)
	}
	outcome(serialResult{err: errors.New("timeout")})
	for range 2 {
		if _, _, err := r.await(quit); err == nil {
			t.Fatal("after a failure: no error")
		}
	}
	var q serialReplay
	q.sent(make(chan serialResult, 1))
	close(quit)
	if _, _, err := q.await(quit); err == nil {
		t.Fatal("after quit: no error")
	}
}
