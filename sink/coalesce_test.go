package sink

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go/jetstream"
)

// recordingKV keeps every watermark Put, in order.
type recordingKV struct {
	jetstream.KeyValue
	puts []watermark
}

func (k *recordingKV) Put(_ context.Context, _ string, b []byte) (uint64, error) {
	var w watermark
	if err := json.Unmarshal(b, &w); err != nil {
		return 0, err
	}
	k.puts = append(k.puts, w)
	return uint64(len(k.puts)), nil
}

// stored is the last watermark put (zero and false before the first).
func (k *recordingKV) stored() (watermark, bool) {
	if len(k.puts) == 0 {
		return watermark{}, false
	}
	return k.puts[len(k.puts)-1], true
}

// coalescingFixture is a dedup watcher whose done callbacks check the
// safety rule of coalesced stores: when an event's done runs, the stored
// watermark already covers it (position and sequence), and it never names
// more than the events acked in order so far.
func coalescingFixture(t *testing.T) (*watcherFixture, *recordingKV, func(id string, lsn, seq uint64) pendingAck) {
	f := newWatcherFixture(t, DedupGuarded)
	kv := &recordingKV{}
	f.p.replays.kv, f.p.replays.key = kv, "k"
	pa := func(id string, lsn, seq uint64) pendingAck {
		p := f.pa(id, lsn, seq-1)
		p.done = func(err error) {
			f.done[id] = append(f.done[id], err)
			w, ok := kv.stored()
			pos := format.Position{CommitLSN: lsn}
			if err == nil && (!ok || w.pos().Less(pos) || w.Seq < seq) {
				t.Errorf("done(%s) at %d/%d ran before a store covering it (stored %+v, %v)", id, lsn, seq, w, ok)
			}
			if ok && w.Seq > f.p.ackedSeq.Load() {
				t.Errorf("stored watermark seq %d is ahead of the in-order acked %d", w.Seq, f.p.ackedSeq.Load())
			}
		}
		return p
	}
	return f, kv, pa
}

// TestAckWatcherCoalescesStores: in dedup mode, events resolved within
// watermarkEvery of the last store wait for one store that covers them all;
// each done runs only after it.
func TestAckWatcherCoalescesStores(t *testing.T) {
	f, kv, pa := coalescingFixture(t)
	f.w.resolve(pa("a", 0x100, 11), ack(11, false), nil)
	if due := f.w.settle(); due != nil { // no store yet: at once
		t.Fatal("first store waits")
	}
	f.wantDone("a", false)
	for i, id := range []string{"b", "c", "d"} {
		f.w.resolve(pa(id, 0x101+uint64(i), 12+uint64(i)), ack(12+uint64(i), false), nil)
	}
	due := f.w.settle()
	if due == nil {
		t.Fatal("a store within watermarkEvery of the last one did not wait")
	}
	if len(f.done) != 1 || len(kv.puts) != 1 {
		t.Fatalf("before the store was due: done %v, %d puts", f.done, len(kv.puts))
	}
	select {
	case <-due:
	case <-time.After(10 * time.Second):
		t.Fatal("the store never came due")
	}
	f.w.flush()
	for _, id := range []string{"b", "c", "d"} {
		f.wantDone(id, false)
	}
	if w, _ := kv.stored(); len(kv.puts) != 2 || w.Seq != 14 || w.CommitLSN != 0x103 {
		t.Fatalf("puts %+v, want two, the last at seq 14, 0x103", kv.puts)
	}
}

// TestAckWatcherCoalesceLimit: at most half the window of resolved events
// waits for a coalesced store: the next one stores at once.
func TestAckWatcherCoalesceLimit(t *testing.T) {
	f, kv, pa := coalescingFixture(t)
	f.p.cfg.MaxPending = 4
	f.w.lastStore = time.Now() // a store just happened
	f.w.resolve(pa("a", 0x100, 11), ack(11, false), nil)
	if len(kv.puts) != 0 {
		t.Fatalf("stored after one event: %+v", kv.puts)
	}
	f.w.resolve(pa("b", 0x101, 12), ack(12, false), nil)
	if len(kv.puts) != 1 || len(f.w.ready) != 0 {
		t.Fatalf("at the limit: %d puts, %d ready", len(kv.puts), len(f.w.ready))
	}
	f.wantDone("a", false)
	f.wantDone("b", false)
}

// TestAckWatcherNoCoalesceWithoutStore: exactly-once keeps no watermark in
// the bucket, so nothing waits for one.
func TestAckWatcherNoCoalesceWithoutStore(t *testing.T) {
	f := newWatcherFixture(t, ExactlyOnce)
	f.w.lastStore = time.Now()
	f.w.resolve(f.pa("a", 0x100, 10), ack(11, false), nil)
	if due := f.w.settle(); due != nil {
		t.Fatal("exactly-once waited for a watermark store")
	}
	f.wantDone("a", false)
}

// TestAckWatcherFailureFlushesCoalesced: a failure lets the events waiting
// for a coalesced store go first (stored, then done), then fails.
func TestAckWatcherFailureFlushesCoalesced(t *testing.T) {
	f, kv, pa := coalescingFixture(t)
	f.w.lastStore = time.Now()
	f.w.resolve(pa("a", 0x100, 11), ack(11, false), nil)
	if f.w.settle() == nil {
		t.Fatal("did not wait")
	}
	f.w.resolve(pa("b", 0x101, 12), nil, context.DeadlineExceeded)
	f.wantDone("a", false)
	f.wantDone("b", true)
	if w, _ := kv.stored(); len(kv.puts) != 1 || w.Seq != 11 {
		t.Fatalf("puts %+v, want one at seq 11", kv.puts)
	}
}
