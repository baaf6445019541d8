package sink_test

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jetbox-dev/jetbox/sink/format"

	"context"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"

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
	p := streamPublisher(t, n, baseConfig())
	ctx := context.Background()
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

// publishN publishes evs in session s and fails on any done error.
func publishN(t *testing.T, s *sink.Session, evs []*decoder.Event) {
	t.Helper()
	errs := make(chan error, len(evs))
	for _, ev := range evs {
		if err := s.Publish(ev, func(err error) { errs <- err }); err != nil {
			t.Fatal(err)
		}
	}
	for range evs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

func events(prefix string, from, to int) []*decoder.Event {
	var evs []*decoder.Event
	for i := from; i < to; i++ {
		evs = append(evs, at(event(fmt.Sprint(prefix, i), "order", "E"), i))
	}
	return evs
}

// TestExactlyOnceClusterResume: exactly-once mode on an R3 stream.
//
// A late-stored duplicate: an earlier attempt of a row is stored after the
// session that republishes it read the stream's last message, so the
// republish comes back Duplicate at the very sequence it expected. It used
// to stop ackedSeq for the rest of the session, and the next session (a
// Postgres restart) found more messages after the last "in-order" ack than
// jetbox has in flight: a false ErrForeignMessage.
//
// Latency: the check of the messages after the last ack read them one by
// one inside a 10 s limit; with ~1,000 of them and 10 ms each way it could
// never finish.
func TestExactlyOnceClusterResume(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	c := testenv.StartCluster(t, 3)
	_, js := c.Connect(t)
	ctx := context.Background()
	open := func(t *testing.T, p *sink.Publisher) *sink.Session {
		t.Helper()
		s, err := p.Open(ctx, "test")
		if err != nil {
			t.Fatalf("open a session: %v", err)
		}
		return s
	}
	closeS := func(t *testing.T, s *sink.Session) {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := s.Close(cctx); err != nil {
			t.Fatal(err)
		}
	}
	setup := func(t *testing.T, name string) sink.Config {
		cfg := baseConfig()
		cfg.Stream, cfg.SubjectPrefix, cfg.Delivery, cfg.MaxPending = name, "outbox", sink.ExactlyOnce, 1024
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"outbox.>"},
			Storage: jetstream.FileStorage, Replicas: 3, Duplicates: time.Minute}); err != nil {
			t.Fatal(err)
		}
		c.WaitStreamCurrent(name)
		t.Cleanup(func() { _ = js.DeleteStream(ctx, name) })
		return cfg
	}

	t.Run("late duplicate", func(t *testing.T) {
		cfg := setup(t, "OUTBOX")
		nc, _ := c.Connect(t)
		p, err := sink.New(nc, cfg, zerolog.New(zerolog.NewTestWriter(t)))
		if err != nil {
			t.Fatal(err)
		}
		s := open(t, p)
		publishN(t, s, events("e-", 0, 5))
		closeS(t, s)

		s = open(t, p) // resumes after seq 5 (row 4)
		// Row 5's earlier attempt lands now, after the session read the
		// stream: exactly the message jetbox sends, with jetbox's headers.
		late := events("e-", 5, 6)[0]
		h := nats.Header{}
		h.Set(jetstream.MsgIDHeader, late.ID)
		h.Set(format.HeaderCommitLSN, late.CommitLSN.String())
		h.Set(format.HeaderTxIndex, "5")
		h.Set(format.HeaderSource, "test")
		if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: late.Subject, Data: late.Payload, Header: h}); err != nil {
			t.Fatal(err)
		}
		publishN(t, s, events("e-", 5, 1106))
		closeS(t, s)
		if st := p.Stats(); st.Duplicates != 1 {
			t.Fatalf("stats %+v: the republished row was not a Duplicate on this server", st)
		}
		// A new session (a Postgres restart, a republish) must resume.
		closeS(t, open(t, p))
		if n := len(testenv.ReadStream(t, js, "OUTBOX", false)); n != 1106 {
			t.Fatalf("%d messages, want 1106", n)
		}
	})

	t.Run("latency", func(t *testing.T) {
		cfg := setup(t, "SLOW")
		proxy := testenv.StartProxy(t, c.Nodes[0].URL[len("nats://"):])
		nc, err := nats.Connect("nats://"+proxy.Addr, nats.IgnoreDiscoveredServers(), nats.MaxReconnects(-1))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		p, err := sink.New(nc, cfg, zerolog.New(zerolog.NewTestWriter(t)))
		if err != nil {
			t.Fatal(err)
		}
		s := open(t, p)
		publishN(t, s, events("s-", 0, 5))
		closeS(t, s)
		proxy.Delay(10 * time.Millisecond)
		// 1,000 publishes whose acks are abandoned (a stop that gave up on
		// them): they are stored, but after the last ack jetbox saw.
		s = open(t, p)
		for _, ev := range events("s-", 5, 1005) {
			if err := s.Publish(ev, func(error) {}); err != nil {
				t.Fatal(err)
			}
		}
		gone, cancel := context.WithCancel(ctx)
		cancel()
		_ = s.Close(gone)
		testenv.WaitFor(t, time.Minute, func() error {
			if n, err := testenv.StreamCount(js, "SLOW"); err != nil || n != 1005 {
				return fmt.Errorf("%d of 1005 stored (%v)", n, err)
			}
			return nil
		})
		start := time.Now()
		closeS(t, open(t, p)) // checks the 1,000 messages after the last ack
		t.Logf("resumed in %s with 10 ms added each way", time.Since(start).Round(time.Millisecond))
	})
}

// TestExactlyOnceLostAcksAddUp: a cut can lose the acks of messages the
// stream stored, and a session that lost one stops counting acks as in
// order. Session after session those stores used to add up against the
// last ack this process saw, until a session open found more of them than
// one session has in flight and stopped with a false ErrForeignMessage (a
// CI run of TestConnectionCuts: "1560 messages were stored after jetbox's
// last acked one"). A session open that checked them moves the base on.
//
// A second publisher with the same source stands for the stores whose acks
// were lost: the first never sees them acked.
func TestExactlyOnceLostAcksAddUp(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	n := testenv.StartNATS(t)
	cfg := baseConfig()
	cfg.Delivery, cfg.MaxPending = sink.ExactlyOnce, 8 // a check bound of 8+16 messages
	p := newPublisher(t, n, cfg)
	lost := newPublisher(t, n, cfg)
	ctx := context.Background()
	if _, err := p.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	session := func(t *testing.T, p *sink.Publisher, evs []*decoder.Event) {
		t.Helper()
		s, err := p.Open(ctx, "test")
		if err != nil {
			t.Fatalf("open a session: %v", err)
		}
		publishN(t, s, evs)
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := s.Close(cctx); err != nil {
			t.Fatal(err)
		}
	}
	session(t, p, events("e-", 0, 10))
	for round := 1; round <= 3; round++ {
		from := 10 + (round-1)*20
		session(t, lost, events("e-", from, from+20)) // 20 stores p never saw acked
		session(t, p, nil)                            // a session open checks them
	}
	_, js := n.Connect(t)
	if got := len(testenv.ReadStream(t, js, "OUTBOX", false)); got != 70 {
		t.Fatalf("%d messages, want 70", got)
	}
}

// TestExactlyOnceAfterAnotherInstance: two jetbox instances on one slot
// write one stream, one at a time. While this process stood by, the active
// one stored more than a window after this process's last ack; its session
// open when it takes over again used to read that as a foreign writer
// ("… more than it had in flight"). Only the window after its last ack can
// hold its own stores (and a foreign message slipped in among them), so
// only that window is checked: a foreign message there still stops it.
//
// A second publisher with the same source stands for the other instance.
func TestExactlyOnceAfterAnotherInstance(t *testing.T) {
	if testing.Short() {
		t.Skip("server test")
	}
	cfg := baseConfig()
	cfg.Delivery, cfg.MaxPending = sink.ExactlyOnce, 8 // a window of 8+16 messages
	ctx := context.Background()
	session := func(t *testing.T, p *sink.Publisher, evs []*decoder.Event) error {
		t.Helper()
		s, err := p.Open(ctx, "test")
		if err != nil {
			return err
		}
		publishN(t, s, evs)
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := s.Close(cctx); err != nil {
			t.Fatal(err)
		}
		return nil
	}
	t.Run("more than a window", func(t *testing.T) {
		n := testenv.StartNATS(t)
		p := streamPublisher(t, n, cfg)
		other := newPublisher(t, n, cfg)
		if err := session(t, p, events("e-", 0, 10)); err != nil {
			t.Fatal(err)
		}
		if err := session(t, other, events("e-", 10, 110)); err != nil { // active while p stood by
			t.Fatal(err)
		}
		// p takes over: the slot replays from before e-5.
		if err := session(t, p, events("e-", 5, 120)); err != nil {
			t.Fatalf("a session open after another instance's 100 stores: %v", err)
		}
		_, js := n.Connect(t)
		got := testenv.ReadStream(t, js, "OUTBOX", false)
		if len(got) != 120 {
			t.Fatalf("%d messages, want 120", len(got))
		}
		for i, m := range got {
			if want := fmt.Sprint("e-", i); m.ID != want {
				t.Fatalf("message %d is %s, want %s", i, m.ID, want)
			}
		}
	})
	t.Run("a foreign message inside the window", func(t *testing.T) {
		n := testenv.StartNATS(t)
		p := streamPublisher(t, n, cfg)
		if err := session(t, p, events("e-", 0, 10)); err != nil {
			t.Fatal(err)
		}
		_, js := n.Connect(t)
		if _, err := js.Publish(ctx, "outbox.order.E", []byte("foreign")); err != nil {
			t.Fatal(err)
		}
		for i := 10; i < 110; i++ { // jetbox's, from this source, after it
			m := nats.NewMsg("outbox.order.E")
			m.Header.Set(jetstream.MsgIDHeader, fmt.Sprint("e-", i))
			m.Header.Set(format.HeaderCommitLSN, "0/16B3748")
			m.Header.Set(format.HeaderTxIndex, fmt.Sprint(i))
			m.Header.Set(format.HeaderSource, "test")
			if _, err := js.PublishMsg(ctx, m); err != nil {
				t.Fatal(err)
			}
		}
		err := session(t, p, nil)
		if !errors.Is(err, sink.ErrForeignMessage) || !strings.Contains(err.Error(), "seq 11") {
			t.Fatalf("a session open after a foreign message at seq 11: %v, want ErrForeignMessage naming it", err)
		}
	})
}
