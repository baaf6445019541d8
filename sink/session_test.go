package sink_test

import (
	"context"
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
