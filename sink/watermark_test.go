package sink_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
)

// TestWatermarkStoresCoalesced: in dedup mode, events acked one at a time
// (1-row transactions at a steady rate) do not each cost a watermark store:
// far fewer stores than events, every done called, and after Close the
// stored watermark is the last event's, at the stream's last sequence.
func TestWatermarkStoresCoalesced(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, baseConfig())
	_, js := n.Connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := p.Open(ctx, "test")
	if err != nil {
		t.Fatal(err)
	}
	const events = 200
	done := make(chan error, events)
	tick := time.NewTicker(time.Millisecond) // the producer's rate: about one event per ms
	defer tick.Stop()
	var last uint64
	for i := range events {
		ev := event("c-"+string(rune('a'+i%26))+string(rune('a'+i/26)), "order", "E")
		ev.CommitLSN = pglogrepl.LSN(0x1000 + i)
		last = uint64(ev.CommitLSN)
		if err := s.Publish(ev, func(err error) { done <- err }); err != nil {
			t.Fatal(err)
		}
		<-tick.C
	}
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for range events {
		if err := <-done; err != nil {
			t.Fatalf("done: %v", err)
		}
	}
	kvStream, err := js.Stream(ctx, "KV_"+sink.WatermarkBucket)
	if err != nil {
		t.Fatal(err)
	}
	info, err := kvStream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if stores := info.State.LastSeq; stores == 0 || stores > events/4 {
		t.Fatalf("%d watermark stores for %d events acked one at a time: want a few (coalesced)", stores, events)
	}
	kv, err := js.KeyValue(ctx, sink.WatermarkBucket)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := kv.Keys(ctx)
	if err != nil || len(keys) != 1 {
		t.Fatalf("bucket keys %v, %v", keys, err)
	}
	e, err := kv.Get(ctx, keys[0])
	if err != nil {
		t.Fatal(err)
	}
	var wm struct {
		Seq       uint64 `json:"seq"`
		CommitLSN uint64 `json:"commit_lsn"`
	}
	if err := json.Unmarshal(e.Value(), &wm); err != nil {
		t.Fatal(err)
	}
	outbox, err := js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	oi, err := outbox.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if wm.CommitLSN != last || wm.Seq != oi.State.LastSeq {
		t.Fatalf("stored watermark %+v, want the last event (commit %#x) at seq %d", wm, last, oi.State.LastSeq)
	}
}
