package sink_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

func newPublisher(t *testing.T, n *testenv.NATS, cfg sink.Config) *sink.Publisher {
	t.Helper()
	nc, _ := n.Connect(t)
	p, err := sink.New(nc, cfg, zerolog.New(zerolog.NewTestWriter(t)))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// streamPublisher is newPublisher with its stream created.
func streamPublisher(t *testing.T, n *testenv.NATS, cfg sink.Config) *sink.Publisher {
	t.Helper()
	p := newPublisher(t, n, cfg)
	if _, err := p.EnsureStream(context.Background()); err != nil {
		t.Fatal(err)
	}
	return p
}

func baseConfig() sink.Config {
	return sink.Config{Stream: "OUTBOX", SubjectPrefix: "outbox", DuplicateWindow: time.Minute,
		PublishTimeout: 5 * time.Second, MaxPending: 64, Delivery: sink.DedupGuarded}
}

// dedup is dedup mode, with the order guard or without.
func dedup(guard bool) sink.Delivery {
	if guard {
		return sink.DedupGuarded
	}
	return sink.Dedup
}

// exactlyOnce is exactly-once mode, or else dedup with the order guard.
func exactlyOnce(exactly bool) sink.Delivery {
	if exactly {
		return sink.ExactlyOnce
	}
	return sink.DedupGuarded
}

func event(id, agg, typ string) *decoder.Event {
	return &decoder.Event{ID: id, Subject: "outbox." + agg + "." + typ, AggregateType: agg, AggregateID: "a1",
		EventType: typ, Payload: []byte(`{"id":"` + id + `"}`), CommitLSN: 0x16B3748, CommitTime: time.Unix(1, 5).UTC(), Origin: "test"}
}

// publishAll publishes evs in one session and returns each done error.
func publishAll(t *testing.T, p *sink.Publisher, evs ...*decoder.Event) []error {
	t.Helper()
	s, err := p.Open(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	errs := make([]error, len(evs))
	for i, ev := range evs {
		i := i
		if err := s.Publish(ev, func(err error) { errs[i] = err }); err != nil {
			errs[i] = err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	return errs
}

func TestEnsureStreamCreatesAndChecks(t *testing.T) {
	n := testenv.StartNATS(t)
	p := newPublisher(t, n, baseConfig())
	ctx := context.Background()
	info, err := p.EnsureStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.Subjects[0] != "outbox.>" || info.Config.Storage != jetstream.FileStorage || info.Config.Duplicates != time.Minute {
		t.Fatalf("created %+v", info.Config)
	}
	if _, err := p.EnsureStream(ctx); err != nil { // existing and fitting: used as is
		t.Fatal(err)
	}

	_, js := n.Connect(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "NARROW", Subjects: []string{"events.order.*"}}); err != nil {
		t.Fatal(err)
	}
	cfg := baseConfig()
	cfg.Stream, cfg.SubjectPrefix = "NARROW", "events"
	_, err = newPublisher(t, n, cfg).EnsureStream(ctx)
	if err == nil || !strings.Contains(err.Error(), `do not capture "events.>"`) {
		t.Fatalf("mismatched stream accepted: %v", err)
	}
}

func TestDedupAndHeaders(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, baseConfig())
	ev := event("id-1", "order", "Created")
	ev.Headers = []decoder.Header{{Key: "traceparent", Value: "00-x"}}
	for _, err := range publishAll(t, p, ev, event("id-2", "order", "Paid")) {
		if err != nil {
			t.Fatal(err)
		}
	}
	// A replay of both (a new session after a restart) is absorbed.
	for _, err := range publishAll(t, p, ev, event("id-2", "order", "Paid"), event("id-3", "order", "Shipped")) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if st := p.Stats(); st.Published != 3 || st.Duplicates != 2 {
		t.Fatalf("stats %+v, want 3 published and 2 duplicates", st)
	}
	_, js := n.Connect(t)
	msgs := testenv.ReadStream(t, js, "OUTBOX", true)
	if len(msgs) != 3 {
		t.Fatalf("%d messages stored", len(msgs))
	}
	h := msgs[0].Header
	if h["traceparent"][0] != "00-x" || h.Get(format.HeaderCommitLSN) != "0/16B3748" ||
		h.Get(format.HeaderCommitTime) != "1970-01-01T00:00:01.000000005Z" || h.Get(format.HeaderTxIndex) != "0" {
		t.Fatalf("headers %v", h)
	}
}

// TestOrderGuardRefusesAfterALostMessage: when one message of a pipeline is
// not stored, every later one is refused, so the stream never has a gap.
// The "lost" message is one whose subject no stream captures.
func TestOrderGuardRefusesAfterALostMessage(t *testing.T) {
	for _, guard := range []bool{true, false} {
		n := testenv.StartNATS(t)
		cfg := baseConfig()
		cfg.Delivery, cfg.SubjectPrefix = dedup(guard), "outbox.ok"
		p := newPublisher(t, n, cfg)
		_, js := n.Connect(t)
		if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.ok.>"}}); err != nil {
			t.Fatal(err)
		}
		lost := event("id-2", "lost", "E")
		errs := publishAll(t, p, event("id-1", "ok", "E"), lost, event("id-3", "ok", "E"), event("id-4", "ok", "E"))
		if errs[0] != nil || errs[1] == nil {
			t.Fatalf("guard=%v: errs %v", guard, errs)
		}
		stored := testenv.ReadStream(t, js, "OUTBOX", false)
		if guard && (len(stored) != 1 || errs[2] == nil || errs[3] == nil) {
			t.Fatalf("guard on: %d stored, errs %v; want only id-1 stored and the rest refused", len(stored), errs)
		}
		if !guard && len(stored) != 3 {
			t.Fatalf("guard off: %d stored (the gap this guard prevents did not happen?)", len(stored))
		}
	}
}

func TestTooLargeIsPermanent(t *testing.T) {
	n := testenv.StartNATS(t, testenv.WithMaxPayload(4096))
	p := streamPublisher(t, n, baseConfig())
	ev := event("big", "order", "E")
	ev.Payload = make([]byte, 8000)
	sess, err := p.Open(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	err = sess.Publish(ev, func(error) { t.Error("done called for an unsent message") })
	var ie *decoder.InvalidEventError
	if !errors.As(err, &ie) || ie.Code != format.ReasonTooLarge || ie.ID != "big" || !strings.Contains(err.Error(), "max_payload") {
		t.Fatalf("got %v", err)
	}

	// The stream's own max_msg_size is reported by the server.
	_, js := n.Connect(t)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: "SMALL", Subjects: []string{"small.>"}, MaxMsgSize: 1000}); err != nil {
		t.Fatal(err)
	}
	cfg := baseConfig()
	cfg.Stream, cfg.SubjectPrefix = "SMALL", "small"
	ev = event("mid", "order", "E")
	ev.Subject, ev.Payload = "small.order.E", make([]byte, 2000)
	errs := publishAll(t, newPublisher(t, n, cfg), ev)
	if !errors.As(errs[0], &ie) || ie.Code != format.ReasonTooLarge || !strings.Contains(errs[0].Error(), "max_msg_size") {
		t.Fatalf("got %v", errs[0])
	}
}

func TestCaptures(t *testing.T) {
	for _, c := range []struct {
		filters []string
		pattern string
		want    bool
	}{
		{[]string{"outbox.>"}, "outbox.>", true},
		{[]string{">"}, "outbox.>", true},
		{[]string{"*.>"}, "outbox.>", true},
		{[]string{"other.>", "outbox.>"}, "outbox.>", true},
		{[]string{"outbox.*"}, "outbox.>", false},
		{[]string{"outbox.*.*"}, "outbox.>", false},
		{[]string{"outbox"}, "outbox.>", false},
		{[]string{"outbox.order.>"}, "outbox.>", false},
		{[]string{"acme.outbox.>"}, "acme.outbox.>", true},
		{[]string{"acme.*.>"}, "acme.outbox.>", true},
		{[]string{"*"}, "outbox.>", false},
	} {
		if got := sink.Captures(c.filters, c.pattern); got != c.want {
			t.Errorf("Captures(%q, %q) = %v, want %v", c.filters, c.pattern, got, c.want)
		}
	}
}

// TestSessionCloseConcurrent: Close may be called again, from another
// goroutine, while a first Close still waits (a shutdown racing a
// republish); it must neither panic nor return early.
func TestSessionCloseConcurrent(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, baseConfig())
	s, err := p.Open(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 64)
	for i := 0; i < 64; i++ {
		if err := s.Publish(event(fmt.Sprint("c-", i), "order", "E"), func(err error) { done <- err }); err != nil {
			t.Fatal(err)
		}
	}
	errs := make(chan error, 3)
	for i := 0; i < 3; i++ {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			errs <- s.Close(ctx)
		}()
	}
	for i := 0; i < 3; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if len(done) != 64 {
		t.Fatalf("%d of 64 acks delivered before Close returned", len(done))
	}
}

// TestExactlyOnceRefusesAnotherSource: positions from another WAL history
// (another database, slot or cluster) are not comparable, so exactly-once
// mode refuses to resume after them instead of skipping events; another
// timeline of the same writer is left to replication's history check.
func TestExactlyOnceRefusesAnotherSource(t *testing.T) {
	n := testenv.StartNATS(t)
	cfg := baseConfig()
	cfg.Delivery = sink.ExactlyOnce
	p := streamPublisher(t, n, cfg)
	s, err := p.Open(context.Background(), "sys/1/app/jetbox")
	if err != nil {
		t.Fatal(err)
	}
	ev := event("id-1", "order", "E")
	ev.Origin = "sys/1/app/jetbox"
	done := make(chan error, 1)
	if err := s.Publish(ev, func(err error) { done <- err }); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	_ = s.Close(context.Background())
	if s, err := p.Open(context.Background(), "sys/1/app/jetbox"); err != nil {
		t.Fatalf("same source refused: %v", err)
	} else {
		_ = s.Close(context.Background())
	}
	// A new timeline of the same system, database and slot (a failover):
	// replication checked it continues the stream before the session opens.
	if s, err := p.Open(context.Background(), "sys/2/app/jetbox"); err != nil {
		t.Fatalf("the same writer on a new timeline refused: %v", err)
	} else {
		_ = s.Close(context.Background())
	}
	for _, other := range []string{"other/1/app/jetbox", "sys/1/other/jetbox", "sys/1/app/other"} {
		_, err = p.Open(context.Background(), other)
		var pe *sink.PermanentError
		if !errors.As(err, &pe) || !strings.Contains(err.Error(), "not comparable") {
			t.Fatalf("another source %s accepted: %v", other, err)
		}
	}
}

func at(ev *decoder.Event, txIndex int) *decoder.Event { ev.TxIndex = txIndex; return ev }

// TestRepeatedIDDetected: a row reusing the id of another row inside the
// duplicate window is reported (JetStream would drop it silently), whether
// it follows that row directly or not; a replay of the same rows is not.
func TestRepeatedIDDetected(t *testing.T) {
	for _, guard := range []bool{true, false} {
		n := testenv.StartNATS(t)
		cfg := baseConfig()
		cfg.Delivery = dedup(guard)
		p := streamPublisher(t, n, cfg)
		isDup := func(err error) bool {
			var ie *decoder.InvalidEventError
			return errors.As(err, &ie) && ie.Code == format.ReasonDuplicateID && strings.Contains(err.Error(), "duplicate window")
		}
		errs := publishAll(t, p, at(event("id-1", "order", "E"), 0), at(event("id-2", "order", "E"), 1), at(event("id-1", "order", "E"), 2))
		if errs[0] != nil || errs[1] != nil || !isDup(errs[2]) {
			t.Fatalf("guard=%v: non-consecutive repeat: %v", guard, errs)
		}
		// The same id twice in a row: refused before publishing.
		errs = publishAll(t, p, at(event("id-3", "order", "E"), 3), at(event("id-3", "order", "E"), 4))
		if errs[0] != nil || !isDup(errs[1]) {
			t.Fatalf("guard=%v: consecutive repeat: %v", guard, errs)
		}
		// A new session whose first row repeats the stream's last id.
		if errs = publishAll(t, p, at(event("id-3", "order", "E"), 5)); !isDup(errs[0]) {
			t.Fatalf("guard=%v: repeat of the stream's last message: %v", guard, errs)
		}
		// A replay of the rows themselves is fine.
		for i, err := range publishAll(t, p, at(event("id-1", "order", "E"), 0), at(event("id-2", "order", "E"), 1), at(event("id-3", "order", "E"), 3)) {
			if err != nil {
				t.Fatalf("guard=%v: replay %d: %v", guard, i, err)
			}
		}
	}
}

// TestStreamGoneOrChanged: a session does not open on a stream deleted, or
// whose subjects no longer capture the prefix; the error is permanent and
// says what to do.
func TestStreamGoneOrChanged(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, baseConfig())
	ctx := context.Background()
	_, js := n.Connect(t)
	if _, err := js.UpdateStream(ctx, jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"elsewhere.>"}, Storage: jetstream.FileStorage, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	var pe *sink.PermanentError
	if _, err := p.Open(ctx, "test"); !errors.As(err, &pe) || !strings.Contains(err.Error(), "no longer capture") {
		t.Fatalf("subjects changed: %v", err)
	}
	if err := js.DeleteStream(ctx, "OUTBOX"); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Open(ctx, "test"); !errors.As(err, &pe) || !strings.Contains(err.Error(), "does not exist") || !strings.Contains(err.Error(), "restart jetbox") {
		t.Fatalf("stream deleted: %v", err)
	}
}

// TestAckFromAnotherStream: jetbox sends no Nats-Expected-Stream; a PubAck
// from another stream that took over the subjects mid-session fails the
// event (it is not confirmed), and the next session refuses to open.
func TestAckFromAnotherStream(t *testing.T) {
	n := testenv.StartNATS(t)
	cfg := baseConfig()
	cfg.Delivery = sink.Dedup // else the expected sequence alone refuses it
	p := streamPublisher(t, n, cfg)
	ctx := context.Background()
	s, err := p.Open(ctx, "test")
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	if err := s.Publish(event("id-1", "order", "Created"), func(err error) { errs <- err }); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	_, js := n.Connect(t)
	if _, err := js.UpdateStream(ctx, jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"elsewhere.>"}, Storage: jetstream.FileStorage, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OTHER", Subjects: []string{"outbox.>"}}); err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(event("id-2", "order", "Paid"), func(err error) { errs <- err }); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err == nil || !strings.Contains(err.Error(), `PubAck comes from stream "OTHER", not "OUTBOX"`) {
		t.Fatalf("ack from another stream: %v", err)
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.Close(cctx); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); st.Published != 1 || st.Errors != 1 {
		t.Fatalf("stats %+v, want 1 published and 1 error", st)
	}
	var pe *sink.PermanentError
	if _, err := p.Open(ctx, "test"); !errors.As(err, &pe) || !strings.Contains(err.Error(), "no longer capture") {
		t.Fatalf("next session: %v", err)
	}
}

// TestWatermarkBucketDeleted: dedup mode keeps its watermark in a KV bucket;
// deleted while jetbox runs, the bucket is created again with the current
// watermark, and every publish is still acked (a cached handle failed every
// ack for ever: nothing confirmed, WAL growing).
func TestWatermarkBucketDeleted(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, baseConfig())
	if errs := publishAll(t, p, at(event("w-1", "order", "E"), 0)); errs[0] != nil {
		t.Fatal(errs[0])
	}
	_, js := n.Connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := js.DeleteKeyValue(ctx, sink.WatermarkBucket); err != nil {
		t.Fatal(err)
	}
	ev := event("w-2", "order", "E")
	ev.CommitLSN++
	if errs := publishAll(t, p, ev); errs[0] != nil {
		t.Fatalf("publish after the bucket was deleted: %v", errs[0])
	}
	kv, err := js.KeyValue(ctx, sink.WatermarkBucket)
	if err != nil {
		t.Fatalf("the bucket was not created again: %v", err)
	}
	keys, err := kv.Keys(ctx)
	if err != nil || len(keys) != 1 {
		t.Fatalf("bucket keys %v, %v: want the watermark", keys, err)
	}
}

// TestAcceptedLostHistoryNotStoredTwice: after --accept-lost-rows (a
// rewind or a timeline break) the slot replays what the server still shares
// with the abandoned history: those events are skipped where the stream
// holds the same id at the same position, the rest is published, and
// nothing is stored twice once the duplicate window has passed.
func TestAcceptedLostHistoryNotStoredTwice(t *testing.T) {
	for _, exactly := range []bool{true, false} {
		t.Run(fmt.Sprintf("exactly-once=%v", exactly), func(t *testing.T) {
			n := testenv.StartNATS(t)
			cfg := baseConfig()
			cfg.Delivery, cfg.DuplicateWindow = exactlyOnce(exactly), 100*time.Millisecond
			p := streamPublisher(t, n, cfg)
			ev := func(id string, lsn uint64) *decoder.Event {
				e := event(id, "order", "E")
				e.CommitLSN, e.Origin = pglogrepl.LSN(lsn), "42/1/app/jetbox"
				return e
			}
			open := func() *sink.Session {
				s, err := p.Open(context.Background(), "42/2/app/jetbox")
				if err != nil {
					t.Fatal(err)
				}
				return s
			}
			s := open()
			for _, e := range []*decoder.Event{ev("a", 0x100), ev("b", 0x200), ev("c", 0x300)} {
				if err := s.Publish(e, func(error) {}); err != nil {
					t.Fatal(err)
				}
			}
			closeCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := s.Close(closeCtx); err != nil {
				t.Fatal(err)
			}
			// The server branched after a: it replays a, then its own history.
			p.ForgetHistory(3, "42/1/app/jetbox", format.Position{CommitLSN: 0x100})
			time.Sleep(3 * cfg.DuplicateWindow) // the hazard: JetStream's dedup no longer helps
			s = open()
			errs := make([]error, 3)
			for i, e := range []*decoder.Event{ev("a", 0x100), ev("x", 0x200), ev("d", 0x400)} {
				e.Origin = "42/2/app/jetbox"
				if err := s.Publish(e, func(err error) { errs[i] = err }); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.Close(closeCtx); err != nil {
				t.Fatal(err)
			}
			for i, err := range errs {
				if err != nil {
					t.Fatalf("event %d: %v", i, err)
				}
			}
			_, js := n.Connect(t)
			var got []string
			for _, m := range testenv.ReadStream(t, js, "OUTBOX", true) {
				got = append(got, m.ID)
			}
			if want := []string{"a", "b", "c", "x", "d"}; fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("stream holds %v, want %v", got, want)
			}
		})
	}
}
