package sink_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

func atomicConfig() sink.Config {
	cfg := baseConfig()
	cfg.Delivery, cfg.MaxPending = sink.ExactlyOnceAtomic, 1024
	return cfg
}

// txn returns n events of one transaction committed at lsn, ids <prefix>-<i>.
func txn(lsn pglogrepl.LSN, prefix string, n int) []*decoder.Event {
	evs := make([]*decoder.Event, n)
	for i := range evs {
		ev := event(fmt.Sprintf("%s-%d", prefix, i), "order", "E")
		ev.CommitLSN, ev.TxIndex, ev.Origin = lsn, i, "test"
		evs[i] = ev
	}
	return evs
}

// atomicRun publishes transactions in one atomic session, ending each, and
// returns every done error in order.
func atomicRun(t *testing.T, p *sink.Publisher, txs ...[]*decoder.Event) []error {
	t.Helper()
	s, err := p.OpenAtomic(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, tx := range txs {
		total += len(tx)
	}
	errs := make([]error, total) // written by done callbacks: never reallocated
	done := make(chan struct{}, total)
	next := 0
	for _, tx := range txs {
		for _, ev := range tx {
			i := next
			next++
			if err := s.Publish(ev, func(err error) { errs[i] = err; done <- struct{}{} }); err != nil {
				errs[i] = err
				done <- struct{}{}
			}
		}
		s.EndTransaction()
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if len(done) != len(errs) {
		t.Fatalf("%d of %d done callbacks ran before Close returned", len(done), len(errs))
	}
	return errs
}

// batches groups stored messages by Nats-Batch-Id, in stream order.
func batches(t *testing.T, msgs []testenv.StreamMsg) [][]testenv.StreamMsg {
	t.Helper()
	var out [][]testenv.StreamMsg
	for _, m := range msgs {
		id := m.Header.Get("Nats-Batch-Id")
		if id == "" {
			t.Fatalf("message seq %d is not part of an atomic batch", m.Seq)
		}
		if len(out) > 0 && out[len(out)-1][0].Header.Get("Nats-Batch-Id") == id {
			out[len(out)-1] = append(out[len(out)-1], m)
		} else {
			out = append(out, []testenv.StreamMsg{m})
		}
	}
	return out
}

// TestAtomicTransactions: small transactions are stored whole, several per
// batch when they queue up; a transaction larger than a batch is stored in
// full chunks; only each transaction's last message carries Jetbox-Tx-Last.
func TestAtomicTransactions(t *testing.T) {
	n := testenv.StartNATS(t)
	p := newPublisher(t, n, atomicConfig())
	if info, err := p.EnsureStream(context.Background()); err != nil || !info.Config.AllowAtomicPublish {
		t.Fatalf("stream created without atomic publish: %v", err)
	}
	var txs [][]*decoder.Event
	for i := 0; i < 40; i++ {
		txs = append(txs, txn(pglogrepl.LSN(0x1000+i), fmt.Sprint("s", i), 1+i%7))
	}
	big := txn(0x9000, "big", 2500)
	txs = append(txs, big, txn(0x9001, "after", 3))
	total := 0
	for _, tx := range txs {
		total += len(tx)
	}
	for i, err := range atomicRun(t, p, txs...) {
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
	}
	_, js := n.Connect(t)
	msgs := testenv.ReadStream(t, js, "OUTBOX", true)
	if len(msgs) != total {
		t.Fatalf("%d messages stored, want %d", len(msgs), total)
	}
	k := 0
	for _, tx := range txs {
		for i, ev := range tx {
			m := msgs[k]
			k++
			if m.ID != ev.ID {
				t.Fatalf("seq %d holds %s, want %s", m.Seq, m.ID, ev.ID)
			}
			if last := m.Header.Get(format.HeaderTxLast) == "true"; last != (i == len(tx)-1) {
				t.Fatalf("%s (row %d of %d): Jetbox-Tx-Last %v", ev.ID, i, len(tx), last)
			}
		}
	}
	// Every batch ends a transaction or is a full chunk of the big one;
	// small transactions are never cut, and some shared a batch.
	shared := false
	for _, b := range batches(t, msgs) {
		if len(b) > 1000 {
			t.Fatalf("a batch of %d messages", len(b))
		}
		end := b[len(b)-1]
		if end.Header.Get(format.HeaderTxLast) != "true" && (len(b) != 1000 || !strings.HasPrefix(end.ID, "big-")) {
			t.Fatalf("batch of %d ending at seq %d (%s) cuts a transaction", len(b), end.Seq, end.ID)
		}
		lsns := map[string]bool{}
		for _, m := range b {
			lsns[m.Header.Get(format.HeaderCommitLSN)] = true
		}
		shared = shared || len(lsns) > 1
	}
	if !shared {
		t.Log("every transaction went in its own batch (the sender was never behind)")
	}
}

// TestAtomicFlushWhenStuck: the open transaction's events go out cut (no
// Jetbox-Tx-Last) only when the window is blocked and nothing else is in
// flight; Close does not publish a transaction whose end it never saw.
func TestAtomicFlushWhenStuck(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, atomicConfig())
	s, err := p.OpenAtomic(context.Background(), "test")
	if err != nil {
		t.Fatal(err)
	}
	tx := txn(0x2000, "f", 8)
	done := make(chan error, len(tx))
	publish := func(evs []*decoder.Event) {
		for _, ev := range evs {
			if err := s.Publish(ev, func(err error) { done <- err }); err != nil {
				t.Fatal(err)
			}
		}
	}
	publish(tx[:5])
	s.Flush(func() bool { return false }) // room will come: nothing sent
	s.Flush(func() bool { return true })  // stuck: the 5 go out
	for i := 0; i < 5; i++ {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	publish(tx[5:])
	s.EndTransaction()
	for i := 0; i < 3; i++ {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	unfinished := txn(0x2001, "u", 2)
	publish(unfinished)
	if err := s.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if err := <-done; err == nil || !strings.Contains(err.Error(), "transaction's end") {
			t.Fatalf("unfinished transaction: %v", err)
		}
	}
	_, js := n.Connect(t)
	msgs := testenv.ReadStream(t, js, "OUTBOX", true)
	if len(msgs) != 8 {
		t.Fatalf("%d messages stored, want 8", len(msgs))
	}
	b := batches(t, msgs)
	if len(b) != 2 || len(b[0]) != 5 || b[0][4].Header.Get(format.HeaderTxLast) != "" || b[1][2].Header.Get(format.HeaderTxLast) != "true" {
		t.Fatalf("batches %d, want the flushed 5 unmarked then 3 ending the transaction", len(b))
	}
}

// TestAtomicReplaySkippedAndRepeatedID: a new session skips what the stream
// holds (by position); a row repeating an id in the duplicate window, or one
// of its own batch, fails alone as duplicate-id while the rest of its batch
// fails plainly, and nothing of that batch is stored.
func TestAtomicReplaySkippedAndRepeatedID(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, atomicConfig())
	first := txn(0x3000, "a", 5)
	for _, err := range atomicRun(t, p, first) {
		if err != nil {
			t.Fatal(err)
		}
	}
	before := p.Stats()
	for _, err := range atomicRun(t, p, first) { // a replay of the same rows
		if err != nil {
			t.Fatal(err)
		}
	}
	if st := p.Stats(); st.Published != before.Published || st.Duplicates != before.Duplicates+5 {
		t.Fatalf("replay: stats %+v after %+v", st, before)
	}
	isDup := func(err error, id string) bool {
		var ie *decoder.InvalidEventError
		return errors.As(err, &ie) && ie.Code == format.ReasonDuplicateID && ie.ID == id
	}
	isInvalid := func(err error) bool { var ie *decoder.InvalidEventError; return errors.As(err, &ie) }
	// Row 2 of the next transaction reuses a stored id.
	tx := txn(0x3001, "b", 4)
	tx[2].ID = "a-1"
	errs := atomicRun(t, p, tx)
	if !isDup(errs[2], "a-1") || errs[0] == nil || isInvalid(errs[0]) || isInvalid(errs[3]) {
		t.Fatalf("stored id repeated: %v", errs)
	}
	// Row 3 repeats row 1 of its own batch.
	tx = txn(0x3002, "c", 4)
	tx[3].ID = "c-1"
	errs = atomicRun(t, p, tx)
	if !isDup(errs[3], "c-1") || !strings.Contains(errs[3].Error(), "same atomic batch") || isInvalid(errs[1]) {
		t.Fatalf("id repeated in its batch: %v", errs)
	}
	_, js := n.Connect(t)
	if msgs := testenv.ReadStream(t, js, "OUTBOX", false); len(msgs) != 5 {
		t.Fatalf("%d messages stored, want the first 5 only", len(msgs))
	}
}

// TestAtomicNeedsTheStreamToAllowIt: a stream without atomic publish is a
// set-up error with its fix, from EnsureStream, Check and OpenAtomic.
func TestAtomicNeedsTheStreamToAllowIt(t *testing.T) {
	n := testenv.StartNATS(t)
	_, js := n.Connect(t)
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.>"}}); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, n, atomicConfig())
	if _, err := p.EnsureStream(ctx); err == nil || !strings.Contains(err.Error(), "allow_atomic") {
		t.Fatalf("EnsureStream: %v", err)
	}
	var pe *sink.PermanentError
	if _, err := p.OpenAtomic(ctx, "test"); !errors.As(err, &pe) || !strings.Contains(pe.Hint, "nats stream edit OUTBOX") {
		t.Fatalf("OpenAtomic: %v", err)
	}
	found := false
	for _, f := range p.Check(ctx, 0) {
		if f.Check == "nats.atomic" {
			found = f.Severity == "error" && strings.Contains(f.Hint, "allow_atomic")
		}
	}
	if !found {
		t.Fatalf("check does not report it: %+v", p.Check(ctx, 0))
	}
}

// TestAtomicBatchLimitFromServer: with the server's batch limit lowered
// (jetstream.limits.batch.max_msgs), jetbox finds it and cuts larger
// transactions into chunks of that size.
func TestAtomicBatchLimitFromServer(t *testing.T) {
	dir := t.TempDir()
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true,
		JetStreamLimits: server.JSLimitOpts{MaxBatchSize: 37}})
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown(); _ = os.RemoveAll(dir) })
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats not ready")
	}
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	p, err := sink.New(nc, atomicConfig(), zerolog.New(zerolog.NewTestWriter(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := p.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	if limit, err := p.AtomicBatchLimit(ctx); err != nil || limit != 37 {
		t.Fatalf("limit %d, %v; want 37", limit, err)
	}
	for _, err := range atomicRun(t, p, txn(0x4000, "l", 100)) {
		if err != nil {
			t.Fatal(err)
		}
	}
	js, _ := jetstream.New(nc)
	sizes := []int{}
	for _, b := range batches(t, testenv.ReadStream(t, js, "OUTBOX", true)) {
		sizes = append(sizes, len(b))
	}
	if fmt.Sprint(sizes) != "[37 37 26]" {
		t.Fatalf("batches of %v, want [37 37 26]", sizes)
	}
}

// TestAtomicReplayNotBlamedOnARow: a batch the stream already holds
// (stored, after this session read the stream's last message, by an earlier
// attempt the server applied after all, or by a stale instance during a
// takeover: same ids, positions and source) is refused for its ids; that is
// a replay, not a repeated id. The batch fails with an error that neither
// names a row nor stops jetbox, and a new session skips those events by
// position and stores the later ones in order.
func TestAtomicReplayNotBlamedOnARow(t *testing.T) {
	n := testenv.StartNATS(t)
	p := streamPublisher(t, n, atomicConfig())
	first := txn(0x5000, "first", 2)
	for _, err := range atomicRun(t, p, first) {
		if err != nil {
			t.Fatal(err)
		}
	}
	s, err := p.OpenAtomic(context.Background(), "test") // reads the stream's last message: first-1
	if err != nil {
		t.Fatal(err)
	}
	tx := txn(0x5001, "r", 3)
	// Behind the session's back, a stale jetbox (its own connection) stores
	// the same transaction.
	for _, err := range atomicRun(t, newPublisher(t, n, atomicConfig()), tx) {
		if err != nil {
			t.Fatal(err)
		}
	}
	errs := make([]error, len(tx))
	done := make(chan struct{}, len(tx))
	for i, ev := range tx {
		if err := s.Publish(ev, func(err error) { errs[i] = err; done <- struct{}{} }); err != nil {
			t.Fatal(err)
		}
	}
	s.EndTransaction()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if len(done) != len(tx) {
		t.Fatalf("%d of %d done callbacks ran", len(done), len(tx))
	}
	for i, err := range errs {
		var ie *decoder.InvalidEventError
		var pe interface{ Permanent() bool }
		switch {
		case err == nil:
			t.Fatalf("event %d: stored twice?", i)
		case errors.As(err, &ie):
			t.Fatalf("event %d: a replay blamed on a row: %v", i, err)
		case errors.As(err, &pe) && pe.Permanent():
			t.Fatalf("event %d: a replay as a permanent error: %v", i, err)
		}
	}
	t.Logf("the replayed batch failed with: %v", errs[0])

	// The republish: a new session skips the replay, stores what follows.
	before := p.Stats()
	after := txn(0x5002, "after", 2)
	for i, err := range atomicRun(t, p, tx, after) {
		if err != nil {
			t.Fatalf("event %d after reopening: %v", i, err)
		}
	}
	if st := p.Stats(); st.Duplicates != before.Duplicates+3 || st.Published != before.Published+2 {
		t.Fatalf("after reopening: stats %+v after %+v, want 3 replays skipped and 2 stored", st, before)
	}
	_, js := n.Connect(t)
	var ids []string
	for _, m := range testenv.ReadStream(t, js, "OUTBOX", true) {
		ids = append(ids, m.ID)
	}
	if got, want := strings.Join(ids, " "), "first-0 first-1 r-0 r-1 r-2 after-0 after-1"; got != want {
		t.Fatalf("stream holds %s, want %s", got, want)
	}
}

// TestAtomicTooLargeNeverStoredInPart: a row over a limit lowered after the
// session opened (the stream's max_msg_size, or the server's max_payload
// after a restart) makes its batch fail: that row fails as too-large (so it
// can be dead lettered), the others plainly. A row the session itself
// refuses for its size fails the session: the rest of its transaction is
// never sealed without it. Nothing of either is stored.
func TestAtomicTooLargeNeverStoredInPart(t *testing.T) {
	for _, c := range []struct {
		name  string
		lower func(t *testing.T, n *testenv.NATS, js jetstream.JetStream, nc *nats.Conn)
		limit string
	}{
		{"stream max_msg_size", func(t *testing.T, n *testenv.NATS, js jetstream.JetStream, nc *nats.Conn) {
			st, err := js.Stream(context.Background(), "OUTBOX")
			if err != nil {
				t.Fatal(err)
			}
			cfg := st.CachedInfo().Config
			cfg.MaxMsgSize = 4096
			if _, err := js.UpdateStream(context.Background(), cfg); err != nil {
				t.Fatal(err)
			}
		}, "the stream's max_msg_size of 4096"},
		{"server max_payload", func(t *testing.T, n *testenv.NATS, js jetstream.JetStream, nc *nats.Conn) {
			n.RestartWith(testenv.WithMaxPayload(4096))
			testenv.WaitFor(t, 30*time.Second, func() error {
				if !nc.IsConnected() || nc.MaxPayload() != 4096 {
					return fmt.Errorf("connected %v, max payload %d", nc.IsConnected(), nc.MaxPayload())
				}
				return nil
			})
		}, "the server's max_payload of 4096"},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := testenv.StartNATS(t)
			nc, js := n.Connect(t)
			p, err := sink.New(nc, atomicConfig(), zerolog.New(zerolog.NewTestWriter(t)))
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if _, err := p.EnsureStream(ctx); err != nil {
				t.Fatal(err)
			}
			s, err := p.OpenAtomic(ctx, "test") // reads the limits
			if err != nil {
				t.Fatal(err)
			}
			c.lower(t, n, js, nc)
			tooLarge := func(err error, id string) bool {
				var ie *decoder.InvalidEventError
				return errors.As(err, &ie) && ie.Code == format.ReasonTooLarge && ie.ID == id
			}
			isInvalid := func(err error) bool { var ie *decoder.InvalidEventError; return errors.As(err, &ie) }

			tx := txn(0x6000, "t", 5)
			tx[3].Payload = []byte(`{"pad":"` + strings.Repeat("x", 8000) + `"}`)
			errs := make([]error, len(tx))
			done := make(chan struct{}, len(tx))
			for i, ev := range tx {
				if err := s.Publish(ev, func(err error) { errs[i] = err; done <- struct{}{} }); err != nil {
					t.Fatal(err)
				}
			}
			s.EndTransaction()
			if err := s.Close(ctx); err != nil {
				t.Fatal(err)
			}
			if !tooLarge(errs[3], "t-3") || !strings.Contains(errs[3].Error(), c.limit) || isInvalid(errs[0]) || isInvalid(errs[4]) || len(done) != 5 {
				t.Fatalf("batch refused for size: %v", errs)
			}

			// A new session reads the lowered limit and refuses row 3 itself.
			s, err = p.OpenAtomic(ctx, "test")
			if err != nil {
				t.Fatal(err)
			}
			errs = make([]error, len(tx))
			done = make(chan struct{}, len(tx))
			for i, ev := range tx {
				err := s.Publish(ev, func(err error) { errs[i] = err; done <- struct{}{} })
				if i == 3 && !tooLarge(err, "t-3") || i < 3 && err != nil || i == 4 && err == nil {
					t.Fatalf("Publish of row %d: %v", i, err)
				}
			}
			s.EndTransaction()
			if err := s.Close(ctx); err != nil {
				t.Fatal(err)
			}
			if len(done) != 3 || errs[0] == nil || errs[2] == nil || isInvalid(errs[0]) {
				t.Fatalf("the rows before the refused one: %v", errs[:3])
			}
			if msgs := testenv.ReadStream(t, js, "OUTBOX", false); len(msgs) != 0 {
				t.Fatalf("%d messages stored, want none", len(msgs))
			}
		})
	}
}
