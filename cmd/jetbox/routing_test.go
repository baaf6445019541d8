package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go/jetstream"
)

// mixedDDL is the outbox and jetbox_emit: both producers.
const mixedDDL = outboxDDL + ";\n" + emitFunctionDDL

// mixedEnv runs jetbox on rows and messages.
var mixedEnv = []string{"JETBOX_SOURCE=table,messages"}

// oracleEvent is one committed outbox event as test_decoding shows it: a
// row of public.outbox or a transactional message with the prefix jetbox.
type oracleEvent struct {
	ID, AggregateID string
	Message         bool
	Last            bool // the last event of its transaction
}

var (
	oracleRowAgg = regexp.MustCompile(`^table public\.outbox: INSERT: id\[(?:uuid|text)\]:'([^']*)'.* aggregate_id\[text\]:'([^']*)'`)
	oracleMsg    = regexp.MustCompile(`(?s)^message: transactional: 1 prefix: jetbox, sz: \d+ content:(.*)$`)
)

// events returns every committed outbox row and outbox message since the
// oracle was created, in commit order (and statement order inside a
// transaction). A message whose content is no envelope has ID "".
func (o *oracle) events() []oracleEvent {
	o.f.t.Helper()
	conn := o.f.conn()
	rows, err := conn.Query(ctxT(o.f.t, 5*time.Minute), "SELECT data FROM pg_logical_slot_peek_changes('oracle', NULL, NULL)")
	if err != nil {
		o.f.t.Fatal(err)
	}
	var out []oracleEvent
	last := -1 // the transaction's last event so far
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			o.f.t.Fatal(err)
		}
		switch {
		case strings.HasPrefix(line, "BEGIN"):
			last = -1
		case strings.HasPrefix(line, "COMMIT"):
			if last >= 0 {
				out[last].Last = true
			}
		}
		if m := oracleRowAgg.FindStringSubmatch(line); m != nil {
			last = len(out)
			out = append(out, oracleEvent{ID: m[1], AggregateID: m[2]})
		} else if m := oracleMsg.FindStringSubmatch(line); m != nil {
			var env struct{ ID, AggregateID string }
			var raw map[string]any
			if json.Unmarshal([]byte(m[1]), &raw) == nil {
				env.ID, _ = raw["id"].(string)
				env.AggregateID, _ = raw["aggregate_id"].(string)
			}
			last = len(out)
			out = append(out, oracleEvent{ID: env.ID, AggregateID: env.AggregateID, Message: true})
		}
	}
	if err := rows.Err(); err != nil {
		o.f.t.Fatal(err)
	}
	return out
}

func eventIDs(evs []oracleEvent) []string {
	ids := make([]string, len(evs))
	for i, e := range evs {
		ids[i] = e.ID
	}
	return ids
}

// mixedTx writes one transaction of n events over the given aggregates,
// each a row or a jetbox_emit message at random, in one round trip.
func mixedTx(ctx context.Context, conn *pgx.Conn, rng *rand.Rand, aggregates []string) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var b pgx.Batch
	for i, agg := range aggregates {
		payload := fmt.Sprintf(`{"agg": %q, "i": %d}`, agg, i)
		if rng.IntN(2) == 0 {
			b.Queue(`INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'E', $2)`, agg, payload)
		} else {
			b.Queue(`SELECT jetbox_emit('order', $1, 'E', $2::jsonb)`, agg, payload)
		}
	}
	if err := tx.SendBatch(ctx, &b).Close(); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// TestMixedRowsAndMessages: rows and jetbox_emit messages mixed in the same
// transactions, from two sessions whose transactions interleave and commit
// out of insert order, reach the stream in commit order and statement
// order, exactly as the test_decoding oracle saw them commit, once each,
// across two SIGKILLs; Jetbox-Tx-Index counts rows and messages together;
// other prefixes, non-transactional messages and heartbeats publish
// nothing. It runs once more with --atomic-transactions: the stream's last
// message is then always a transaction's end (Jetbox-Tx-Last), whether the
// transaction ends with a row or a message.
func TestMixedRowsAndMessages(t *testing.T) {
	for _, mode := range []struct {
		name string
		env  []string
	}{{"per-event", nil}, {"atomic", []string{"JETBOX_ATOMIC_TRANSACTIONS=true", "JETBOX_DELIVERY=exactly-once"}}} {
		t.Run(mode.name, func(t *testing.T) { testMixedRowsAndMessages(t, mode.env) })
	}
}

func testMixedRowsAndMessages(t *testing.T, extra []string) {
	f := newFixture(t, withDDL(mixedDDL))
	o := f.newOracle()
	env := append(append([]string{"JETBOX_HEARTBEAT_INTERVAL=1s"}, mixedEnv...), extra...)
	atomicTx := len(extra) > 0
	p := f.start(env...)
	f.waitStreaming(p)
	ctx := ctxT(t, 2*time.Minute)

	// Commit order differs from statement order: B starts after A and commits first.
	a, b := f.conn(), f.conn()
	txA, err := a.Begin(ctx)
	must(t, err)
	txB, err := b.Begin(ctx)
	must(t, err)
	ins := `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'E', '{}')`
	emit := `SELECT jetbox_emit('order', $1, 'E', '{}')`
	_, err = txA.Exec(ctx, ins, "a")
	must(t, err)
	_, err = txB.Exec(ctx, emit, "b")
	must(t, err)
	_, err = txA.Exec(ctx, emit, "a")
	must(t, err)
	_, err = txA.Exec(ctx, `SELECT pg_logical_emit_message(true, 'someone-else', 'x'), pg_logical_emit_message(false, 'jetbox', '{}')`)
	must(t, err)
	_, err = txA.Exec(ctx, ins, "a")
	must(t, err)
	_, err = txB.Exec(ctx, ins, "b")
	must(t, err)
	must(t, txB.Commit(ctx))
	must(t, txA.Commit(ctx))
	f.waitCount(5, 30*time.Second)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	want := o.events()
	assertIDs(t, msgs, eventIDs(want))
	// B: message, row; A: row, message, (two ignored messages), row.
	for i, w := range []struct {
		message bool
		index   string
	}{{true, "0"}, {false, "1"}, {false, "0"}, {true, "1"}, {false, "2"}} {
		if want[i].Message != w.message || msgs[i].Header.Get("Jetbox-Tx-Index") != w.index {
			t.Fatalf("event %d: message %v, Jetbox-Tx-Index %q; want %v, %q", i, want[i].Message, msgs[i].Header.Get("Jetbox-Tx-Index"), w.message, w.index)
		}
	}
	if msgs[0].Subject != "outbox.order.E" || msgs[0].Header.Get("Jetbox-Aggregate-Id") != "b" || string(msgs[0].Data) != "{}" {
		t.Fatalf("message event %+v", msgs[0])
	}

	// Load from two sessions, with two kills; the check stays exact.
	wait := mixedLoad(ctx, f, 1, 150, func(rng *rand.Rand) []string {
		aggs := make([]string, 1+rng.IntN(8))
		for j := range aggs {
			aggs[j] = "agg-" + strconv.Itoa(rng.IntN(20))
		}
		return aggs
	})
	for _, at := range []int{300, 800} {
		waitAtLeast(t, f, at, time.Minute)
		p.kill()
		p = f.start(env...)
	}
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	want = o.events()
	f.waitCount(len(want), time.Minute)
	f.assertStream(eventIDs(want))
	if atomicTx {
		lasts := map[string]bool{}
		for _, e := range want {
			lasts[e.ID] = e.Last
		}
		batches := assertTransactions(t, testenv.ReadStream(t, f.js, "OUTBOX", true), lasts, nil)
		t.Logf("%d events in %d atomic batches", len(want), len(batches))
	}
	// The last start may have had nothing left to publish: stop it only once
	// it streams (a SIGTERM before its signal handler would kill it).
	testenv.WaitFor(t, time.Minute, func() error {
		if !strings.Contains(p.logText(), `"message":"streaming"`) {
			return errors.New("the last jetbox is not streaming yet")
		}
		return nil
	})
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
}

// mixedLoad runs two writer sessions, each committing txs mixed
// transactions (mixedTx) of the aggregates aggs returns, seeded by seed; wait
// returns the first error once both are done.
func mixedLoad(ctx context.Context, f *fixture, seed uint64, txs int, aggs func(*rand.Rand) []string) (wait func() error) {
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			conn, err := pgx.Connect(ctx, f.pg.DSN)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close(context.Background())
			rng := rand.New(rand.NewPCG(uint64(w), seed))
			for i := 0; i < txs; i++ {
				if err := mixedTx(ctx, conn, rng, aggs(rng)); err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	return func() error {
		wg.Wait()
		close(errs)
		return <-errs // nil once closed and empty
	}
}

// waitAtLeast waits until the stream holds n messages or more.
func waitAtLeast(t *testing.T, f *fixture, n int, timeout time.Duration) {
	t.Helper()
	testenv.WaitFor(t, timeout, func() error {
		got, err := testenv.StreamCount(f.js, "OUTBOX")
		if err != nil {
			return err
		}
		if got < uint64(n) {
			return fmt.Errorf("stream holds %d of %d messages", got, n)
		}
		return nil
	})
}

// TestBadEnvelope: a message that is no envelope stops jetbox (exit 1,
// the slot kept before it, the same stop on restart) with the reason and
// the fix; with --on-invalid=dead-letter it becomes a dead letter on
// outbox._dlq.bad-envelope carrying the content, in commit order, and the
// events after it go on.
func TestBadEnvelope(t *testing.T) {
	f := newFixture(t, withDDL(mixedDDL))
	o := f.newOracle()
	p := f.start(mixedEnv...)
	f.waitStreaming(p)
	conn := f.conn()
	ctx := ctxT(t, 2*time.Minute)
	var good string
	must(t, conn.QueryRow(ctx, `SELECT jetbox_emit('order', '1', 'E', '{}')::text`).Scan(&good))
	f.waitCount(1, 30*time.Second)
	const bad = `{"id": "m-bad", "aggregate_type": "order", "aggregate_id": "2", "event-type": "E", "payload": {}}`
	f.pg.Exec(t, fmt.Sprintf(`BEGIN; SELECT pg_logical_emit_message(true, 'jetbox', '%s'); SELECT jetbox_emit('order', '3', 'E', '{}'); COMMIT`, bad))
	badEnd := o.lastCommitEnd()
	for run := 0; run < 2; run++ {
		if code := p.wait(time.Minute); code != exitFailure {
			t.Fatalf("run %d: exit %d, want %d", run, code, exitFailure)
		}
		for _, want := range []string{"outbox message id=(none)", `unknown field \"event-type\"`, "jetbox_emit", "--on-invalid=dead-letter"} {
			if !strings.Contains(p.logText(), want) {
				t.Fatalf("run %d: log lacks %q:\n%s", run, want, p.tail(3000))
			}
		}
		lsn, _, err := f.slotState()
		must(t, err)
		if lsn >= badEnd {
			t.Fatalf("slot confirmed to %s, past the bad message's transaction (ends %s)", lsn, badEnd)
		}
		if run == 0 {
			p = f.start(mixedEnv...)
		}
	}
	if got := testenv.ReadStream(t, f.js, "OUTBOX", false); len(got) != 1 || got[0].ID != good {
		t.Fatalf("stream %+v", got)
	}

	p = f.start(append([]string{"JETBOX_ON_INVALID=dead-letter"}, mixedEnv...)...)
	want := o.events()
	f.waitCount(len(want), time.Minute)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	if len(msgs) != 3 || msgs[0].ID != good || msgs[2].ID != want[2].ID {
		t.Fatalf("stream %+v, oracle %+v", msgs, want)
	}
	dl := msgs[1]
	if dl.Subject != "outbox._dlq."+format.ReasonBadEnvelope || string(dl.Data) != bad ||
		dl.Header.Get(format.HeaderDeadLetterReason) != format.ReasonBadEnvelope || dl.Header.Get(format.HeaderMessagePrefix) != "jetbox" {
		t.Fatalf("dead letter %+v", dl)
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
}

// TestPartitionedConsumers: with {partition} in the subject, 4 durable
// consumers, each filtered to one partition, share 20,000 events over 500
// aggregates (rows and messages mixed) while jetbox is killed three times:
// every aggregate's events reach exactly one consumer (the one of
// Partition(aggregate_id, 4)), in commit order, each once (a redelivered
// event counts once), and the stream holds each event once.
func TestPartitionedConsumers(t *testing.T) {
	const (
		parts, aggregates, events, perTx = 4, 500, 20000, 20
	)
	f := newFixture(t, withDDL(mixedDDL))
	o := f.newOracle()
	env := append([]string{"JETBOX_SUBJECT_TEMPLATE={prefix}.{aggregate_type}.{partition}.{event_type}", "JETBOX_PARTITIONS=4"}, mixedEnv...)
	p := f.start(env...)
	f.waitStreaming(p)
	ctx := ctxT(t, 3*time.Minute)
	stream, err := f.js.Stream(ctx, "OUTBOX")
	must(t, err)

	type got struct {
		mu   sync.Mutex
		seen map[string]bool
		// per aggregate, ids in the order first received
		order map[string][]string
	}
	recv := make([]*got, parts)
	for i := 0; i < parts; i++ {
		recv[i] = &got{seen: map[string]bool{}, order: map[string][]string{}}
		cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
			Durable: fmt.Sprintf("part-%d", i), FilterSubject: fmt.Sprintf("outbox.*.%d.*", i),
			AckPolicy: jetstream.AckExplicitPolicy, MaxAckPending: 1, AckWait: 5 * time.Second})
		must(t, err)
		r := recv[i]
		cc, err := cons.Consume(func(m jetstream.Msg) {
			id, agg := m.Headers().Get("Nats-Msg-Id"), m.Headers().Get("Jetbox-Aggregate-Id")
			r.mu.Lock()
			if !r.seen[id] {
				r.seen[id] = true
				r.order[agg] = append(r.order[agg], id)
			}
			r.mu.Unlock()
			_ = m.Ack()
		})
		must(t, err)
		t.Cleanup(cc.Stop)
	}

	wait := mixedLoad(ctx, f, 7, events/perTx/2, func(rng *rand.Rand) []string {
		aggs := make([]string, perTx)
		for j := range aggs {
			aggs[j] = "agg-" + strconv.Itoa(rng.IntN(aggregates))
		}
		return aggs
	})
	for _, at := range []int{4000, 9000, 14000} {
		waitAtLeast(t, f, at, time.Minute)
		p.kill()
		p = f.start(env...)
	}
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	f.waitCount(events, time.Minute)
	testenv.WaitFor(t, time.Minute, func() error {
		n := 0
		for _, r := range recv {
			r.mu.Lock()
			n += len(r.seen)
			r.mu.Unlock()
		}
		if n != events {
			return fmt.Errorf("consumers received %d of %d events", n, events)
		}
		return nil
	})

	want := map[string][]string{} // per aggregate, in commit order
	all := o.events()
	if len(all) != events {
		t.Fatalf("oracle saw %d events, want %d", len(all), events)
	}
	messages := 0
	for _, e := range all {
		want[e.AggregateID] = append(want[e.AggregateID], e.ID)
		if e.Message {
			messages++
		}
	}
	if messages < events/3 || messages > 2*events/3 {
		t.Fatalf("%d of %d events were messages: not a mixed load", messages, events)
	}
	owner := map[string]int{}
	for i, r := range recv {
		for agg, ids := range r.order {
			if j, dup := owner[agg]; dup {
				t.Fatalf("aggregate %s reached consumers %d and %d", agg, j, i)
			}
			owner[agg] = i
			if p := decoder.Partition(agg, parts); p != i {
				t.Fatalf("aggregate %s reached consumer %d, its partition is %d", agg, i, p)
			}
			if strings.Join(ids, ",") != strings.Join(want[agg], ",") {
				t.Fatalf("aggregate %s: consumer %d got %d events %v..., commit order has %d %v...", agg, i, len(ids), ids[:min(3, len(ids))], len(want[agg]), want[agg][:min(3, len(want[agg]))])
			}
		}
	}
	if len(owner) != len(want) {
		t.Fatalf("%d aggregates received, %d committed", len(owner), len(want))
	}
	f.assertStream(eventIDs(all))
	t.Logf("%d events (%d messages) over %d aggregates, per consumer: %d %d %d %d aggregates", events, messages, len(want),
		countOwned(owner, 0), countOwned(owner, 1), countOwned(owner, 2), countOwned(owner, 3))
}

func countOwned(owner map[string]int, i int) int {
	n := 0
	for _, o := range owner {
		if o == i {
			n++
		}
	}
	return n
}

// TestMessagesOnlySource: --source=messages needs no outbox table: check
// passes on a database without one (creating an empty publication), run
// publishes jetbox_emit events, and check confirms that the stream captures
// every subject of the template, or refuses it.
func TestMessagesOnlySource(t *testing.T) {
	f := newFixture(t, withDDL(emitFunctionDDL))
	base := []string{"--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL, "--source=messages"}
	var out, errOut strings.Builder
	if code := realMain(append([]string{"check", "--subject-template={prefix}.{aggregate_type}.{aggregate_id}.{event_type}"}, base...), &out, &errOut); code != exitOK ||
		!strings.Contains(out.String(), "no outbox table") || !strings.Contains(out.String(), "PUBLICATION \"jetbox\"") ||
		!strings.Contains(out.String(), "pg_logical_emit_message(true, \"jetbox\"") {
		t.Fatalf("check: exit %d:\n%s%s", code, out.String(), errOut.String())
	}
	p := f.start("JETBOX_SOURCE=messages")
	f.waitStreaming(p)
	o := f.newOracle()
	f.pg.Exec(t, `SELECT jetbox_emit('order', '1', 'E', '{"a": 1}'); INSERT INTO other (note) VALUES ('not an event')`)
	f.waitCount(1, 30*time.Second)
	f.assertStream(eventIDs(o.events()))
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}

	out.Reset()
	if code := realMain(append([]string{"check", "--subject-template={prefix}.{aggregate_type}.{aggregate_id}.{event_type}"}, base...), &out, &errOut); code != exitOK ||
		!strings.Contains(out.String(), "captures every subject the subject template produces (outbox.*.*.*)") {
		t.Fatalf("check: exit %d:\n%s", code, out.String())
	}

	// A stream limited to three-token subjects cannot hold a four-token template's.
	st, err := f.js.Stream(ctxT(t, 5*time.Second), "OUTBOX")
	must(t, err)
	cfg := st.CachedInfo().Config
	cfg.Subjects = []string{"outbox.*.*"}
	_, err = f.js.UpdateStream(ctxT(t, 5*time.Second), cfg)
	must(t, err)
	out.Reset()
	code := realMain(append([]string{"check", "--subject-template={prefix}.{aggregate_type}.{aggregate_id}.{event_type}"}, base...), &out, &errOut)
	if code != exitConfig || !strings.Contains(out.String(), `do not capture "outbox.>"`) || strings.Contains(out.String(), "captures every subject the subject template") {
		t.Fatalf("check: exit %d:\n%s", code, out.String())
	}
}
