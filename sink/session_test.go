package sink_test

import (
	"fmt"

	"context"
	"github.com/jetbox-dev/jetbox/decoder"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// TestCloseDuringSlowDuplicateCheck: a Duplicate PubAck after the watermark
// makes the ack goroutine read the original message; a stop while that read
// hangs (the link to NATS went dead) must end with Close's deadline, not
// wait for the read's publish timeout as well.
func TestCloseDuringSlowDuplicateCheck(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	n := testenv.StartNATS(t)
	_, js := n.Connect(t)
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.>"}, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	// The stream's last message is not jetbox's: no watermark, so every
	// Duplicate PubAck is checked against its original.
	for _, id := range []string{"id-1", "id-2"} {
		if _, err := js.Publish(ctx, "outbox.order.E", []byte("x"), jetstream.WithMsgID(id)); err != nil {
			t.Fatal(err)
		}
	}
	proxy := testenv.StartProxy(t, n.URL[len("nats://"):])
	nc, err := nats.Connect("nats://"+proxy.Addr, nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	cfg := baseConfig()
	cfg.PublishTimeout = time.Minute // far beyond the stop's deadline
	p, err := sink.New(nc, cfg, zerolog.New(zerolog.NewTestWriter(t)))
	if err != nil {
		t.Fatal(err)
	}
	s, err := p.Open(ctx, "test")
	if err != nil {
		t.Fatal(err)
	}
	// Blackhole the link as soon as jetbox asks for the original.
	proxy.PauseOn([]byte("MSG.GET"))
	done := make(chan error, 1)
	if err := s.Publish(event("id-1", "order", "E"), func(err error) { done <- err }); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, func() error {
		if !proxy.Paused() { // the check's read is on its way
			return context.DeadlineExceeded
		}
		return nil
	})
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	start := time.Now()
	if err := s.Close(cctx); err == nil {
		t.Fatal("Close returned nil though the duplicate check could not finish")
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Fatalf("Close took %s with a 1s deadline: the duplicate check held the stop for its publish timeout", took)
	}
	proxy.Resume()
}

// TestReplayWithoutWatermark: in dedup mode, when the stream's last message
// is gone (a purge here; WorkQueue or Interest retention, max-age), a
// session has no watermark and its replays carry the order guard. On one
// nats-server the expected sequence is checked before the duplicate id:
// every replay after the first used to be refused (one event per session).
// All replays and the new events after them must go in one session, new
// ones in order.
func TestReplayWithoutWatermark(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	n := testenv.StartNATS(t)
	p := newPublisher(t, n, baseConfig())
	ctx := context.Background()
	if _, err := p.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	var evs []*decoder.Event
	for i := 0; i < 50; i++ {
		evs = append(evs, at(event(fmt.Sprint("r-", i), "order", "E"), i))
	}
	for i, err := range publishAll(t, p, evs[:30]...) {
		if err != nil {
			t.Fatalf("first run, event %d: %v", i, err)
		}
	}
	_, js := n.Connect(t)
	st, err := js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	// A restart replays the 30 (Duplicates: their ids are still in the
	// window) and goes on with 20 new ones.
	for i, err := range publishAll(t, p, evs...) {
		if err != nil {
			t.Fatalf("replay session, event %d: %v", i, err)
		}
	}
	got := testenv.ReadStream(t, js, "OUTBOX", false)
	if len(got) != 20 {
		t.Fatalf("%d messages after the purge, want the 20 new ones", len(got))
	}
	for i, m := range got {
		if m.ID != evs[30+i].ID {
			t.Fatalf("message %d is %s, want %s", i, m.ID, evs[30+i].ID)
		}
	}
	if st := p.Stats(); st.Duplicates != 30 || st.Published != 50 {
		t.Fatalf("stats %+v, want 50 published and 30 duplicates", st)
	}
}
