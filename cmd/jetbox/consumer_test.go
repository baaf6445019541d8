package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestConsumerGuideQuotesCode keeps docs/consumers.md's code blocks equal to
// the example they quote (consumer_example_test.go, which TestConsumerGuide
// runs): each `<!-- example: NAME -->` line is followed by a go block holding
// exactly the file's "guide:begin NAME" region, and every region is quoted.
func TestConsumerGuideQuotesCode(t *testing.T) {
	src, err := os.ReadFile("consumer_example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../../docs/consumers.md")
	if err != nil {
		t.Fatal(err)
	}
	regions := map[string]string{}
	for _, m := range regexp.MustCompile(`(?s)// guide:begin (\w+)\n(.*?)\n// guide:end\n`).FindAllStringSubmatch(string(src), -1) {
		regions[m[1]] = strings.TrimRight(m[2], "\n")
	}
	if len(regions) < 5 {
		t.Fatalf("found %d guide regions in consumer_example_test.go, want 5", len(regions))
	}
	quoted := map[string]bool{}
	for _, m := range regexp.MustCompile("(?s)<!-- example: (\\w+) -->\n```go\n(.*?)\n```").FindAllStringSubmatch(string(doc), -1) {
		name, block := m[1], m[2]
		want, ok := regions[name]
		if !ok {
			t.Errorf("docs/consumers.md quotes example %q, which consumer_example_test.go does not have", name)
			continue
		}
		quoted[name] = true
		if block != want {
			t.Errorf("docs/consumers.md's example %q differs from consumer_example_test.go; paste it again:\n%s", name, want)
		}
	}
	for name := range regions {
		if !quoted[name] {
			t.Errorf("docs/consumers.md does not quote example %q", name)
		}
	}
}

// instance is one running billing instance of TestConsumerGuide.
type instance struct {
	*billing
	nc     *nats.Conn
	cancel context.CancelFunc
	done   chan struct{}
}

// stop ends the instance and waits for it.
func (in *instance) stop() {
	in.cancel()
	<-in.done
}

// TestConsumerGuide runs docs/consumers.md's consumer against the real
// jetbox binary publishing to a real NATS server, with the consumer's inbox,
// position and side-effect (ledger) tables in a real Postgres: an instance
// crashes between COMMIT and ack, a slow message is redelivered to a second
// instance while the first still holds it, a poison message exhausts
// MaxDeliver and becomes a dead letter through the server's advisory, and a
// copy stored again beyond the duplicate window after the inbox was pruned is
// skipped by position. Every side effect happens exactly once, in stream order.
func TestConsumerGuide(t *testing.T) {
	f := newFixture(t)
	// A short duplicate window, so that the last phase can store a copy.
	p := f.start("JETBOX_DUPLICATE_WINDOW=1s")
	f.waitStreaming(p)
	f.pg.Exec(t, consumerSchema+`;
		CREATE TABLE ledger (seq bigserial PRIMARY KEY, msg_id text NOT NULL, aggregate_id text NOT NULL, amount int NOT NULL)`)
	ctx := ctxT(t, 5*time.Minute)
	stream, err := f.js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	cfg := billingConsumer()
	cfg.AckWait, cfg.MaxDeliver = time.Second, 3 // the test's redeliveries come quickly
	if _, err := f.js.CreateOrUpdateConsumer(ctx, "OUTBOX", cfg); err != nil {
		t.Fatal(err)
	}

	// The side effect: a ledger row without a unique constraint, so a second
	// application would show. "slow" blocks its first attempt until released;
	// "poison" always fails.
	var slowCalls, poisonCalls atomic.Int64
	release := make(chan struct{})
	apply := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		var ev struct {
			Kind string `json:"kind"`
			N    int    `json:"n"`
		}
		if err := json.Unmarshal(msg.Data(), &ev); err != nil {
			return err
		}
		switch ev.Kind {
		case "poison":
			poisonCalls.Add(1)
			return errors.New("cannot bill this order")
		case "slow":
			if slowCalls.Add(1) == 1 {
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger (msg_id, aggregate_id, amount) VALUES ($1, $2, $3)`,
			msg.Headers().Get(jetstream.MsgIDHeader), msg.Headers().Get("Jetbox-Aggregate-Id"), ev.N)
		return err
	}
	start := func(nc *nats.Conn) *instance {
		t.Helper()
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		cons, err := js.Consumer(ctx, "OUTBOX", "billing")
		if err != nil {
			t.Fatal(err)
		}
		ictx, cancel := context.WithCancel(ctx)
		in := &instance{billing: &billing{db: f.pg.Conn(t), apply: apply, retry: 50 * time.Millisecond},
			nc: nc, cancel: cancel, done: make(chan struct{})}
		go func() {
			defer close(in.done)
			if err := in.run(ictx, cons); err != nil {
				t.Errorf("billing instance: %v", err)
			}
		}()
		t.Cleanup(in.stop)
		return in
	}
	query := func(sql string, args ...any) int64 {
		t.Helper()
		var n int64
		if err := f.pg.Conn(t).QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	count := func(sql string, args ...any) func() error {
		return func() error {
			var n int64
			conn, err := pgx.Connect(ctx, f.pg.DSN)
			if err != nil {
				return err
			}
			defer conn.Close(ctx)
			if err := conn.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
				return err
			}
			if n == 0 {
				return fmt.Errorf("no row yet: %s", sql)
			}
			return nil
		}
	}
	ackedThrough := func(seq uint64) func() error {
		return func() error {
			info, err := f.js.Consumer(ctx, "OUTBOX", "billing")
			if err != nil {
				return err
			}
			i := info.CachedInfo()
			if i.AckFloor.Stream < seq || i.NumAckPending != 0 {
				return fmt.Errorf("consumer acked through stream sequence %d with %d pending, want %d", i.AckFloor.Stream, i.NumAckPending, seq)
			}
			return nil
		}
	}
	lastSeq := func() uint64 {
		t.Helper()
		info, err := stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.LastSeq
	}
	insert := func(kind string) string {
		t.Helper()
		var id string
		if err := f.pg.Conn(t).QueryRow(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
			VALUES ('order', 'd', 'OrderCreated', jsonb_build_object('kind', $1::text, 'n', 1)) RETURNING id::text`, kind).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	conn := f.conn()
	committed := 0
	writeOrders := func() {
		for tx := 0; tx < 4; tx++ {
			for _, agg := range []string{"a", "b", "c"} {
				committed += len(f.insertTx(conn, agg, 2))
			}
		}
	}

	// 1. An instance crashes between COMMIT and ack: its NATS connection goes
	// through a proxy that holds back its first ack, and the connection is cut
	// with the ack still held.
	writeOrders()
	f.waitCount(committed, time.Minute)
	proxy := testenv.StartProxy(t, strings.TrimPrefix(f.natURL, "nats://"))
	proxy.PauseOn([]byte("PUB $JS.ACK."))
	ncA, err := nats.Connect("nats://"+proxy.Addr, nats.NoReconnect())
	if err != nil {
		t.Fatal(err)
	}
	a := start(ncA)
	testenv.WaitFor(t, time.Minute, func() error {
		if !proxy.Paused() {
			return errors.New("no ack sent yet")
		}
		return count(`SELECT count(*) FROM inbox`)()
	})
	a.stop()
	proxy.Cut()
	proxy.PauseOn(nil)
	proxy.Resume()
	ncA.Close()
	var crashedID string
	var crashedSeq uint64
	if err := f.conn().QueryRow(ctx, `SELECT msg_id, stream_seq FROM inbox`).Scan(&crashedID, &crashedSeq); err != nil {
		t.Fatalf("the crashed instance's inbox row: %v", err)
	}
	if a.applied.Load() != 1 {
		t.Fatalf("the crashed instance applied %d messages, want 1", a.applied.Load())
	}
	if info, err := stream.Consumer(ctx, "billing"); err != nil {
		t.Fatal(err)
	} else if i := info.CachedInfo(); i.AckFloor.Stream >= crashedSeq || i.NumAckPending != 1 {
		t.Fatalf("the crashed instance's ack reached the server: ack floor %d, %d pending", i.AckFloor.Stream, i.NumAckPending)
	}
	ncB, _ := f.nats.Connect(t)
	b := start(ncB)
	testenv.WaitFor(t, time.Minute, ackedThrough(lastSeq()))
	if n := query(`SELECT count(*) FROM ledger WHERE msg_id = $1`, crashedID); n != 1 {
		t.Fatalf("the message committed by the crashed instance was applied %d times", n)
	}
	if b.duplicates.Load() < 1 {
		t.Fatalf("the message committed by the crashed instance was not redelivered as a duplicate (applied %d)", b.applied.Load())
	}
	t.Logf("crash between COMMIT and ack of %s (stream sequence %d): redelivered, acked as a duplicate", crashedID, crashedSeq)

	// 2. Two instances receive the same message: the first is slow, so after
	// AckWait the server redelivers it to the second, whose inbox INSERT waits
	// on the first's transaction; released, the first commits and the second
	// acks without acting.
	ncC, _ := f.nats.Connect(t)
	c := start(ncC)
	dupsBefore := b.duplicates.Load() + c.duplicates.Load()
	slowID := insert("slow")
	testenv.WaitFor(t, time.Minute, count(`SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO inbox%'`))
	close(release)
	f.waitCount(committed+1, time.Minute)
	committed++
	testenv.WaitFor(t, time.Minute, ackedThrough(lastSeq()))
	if n := slowCalls.Load(); n != 1 {
		t.Fatalf("the slow message's side effect ran %d times", n)
	}
	// The first instance's ack may move the ack floor before the second one's
	// transaction returns: wait for its outcome.
	testenv.WaitFor(t, time.Minute, func() error {
		if got := b.duplicates.Load() + c.duplicates.Load() - dupsBefore; got < 1 {
			return fmt.Errorf("%d duplicates of the slow message (failed attempts %d), want at least 1", got, b.failed.Load()+c.failed.Load())
		}
		return nil
	})

	// 3. A poison message: MaxDeliver failed attempts, the advisory, a dead
	// letter; the next message goes on.
	sub, err := subscribeMaxDeliveries(b.nc, "OUTBOX", "billing")
	if err != nil {
		t.Fatal(err)
	}
	dctx, dcancel := context.WithCancel(ctx)
	var dwg sync.WaitGroup
	dwg.Add(1)
	go func() {
		defer dwg.Done()
		if err := recordDeadLetters(dctx, sub, stream, f.pg.Conn(t)); err != nil {
			t.Errorf("dead letters: %v", err)
		}
	}()
	defer func() { dcancel(); dwg.Wait() }()
	poisonID := insert("poison")
	afterPoison := insert("")
	committed += 2
	f.waitCount(committed, time.Minute)
	testenv.WaitFor(t, time.Minute, count(`SELECT count(*) FROM ledger WHERE msg_id = $1`, afterPoison))
	testenv.WaitFor(t, time.Minute, count(`SELECT count(*) FROM dead_letters WHERE msg_id = $1 AND deliveries = $2`, poisonID, cfg.MaxDeliver))
	if n := poisonCalls.Load(); n != int64(cfg.MaxDeliver) {
		t.Fatalf("the poison message was attempted %d times, want MaxDeliver = %d", n, cfg.MaxDeliver)
	}

	// 4. Beyond the duplicate window: jetbox stopped, the inbox pruned, and a
	// copy of the first message stored again (as dedup mode does after a
	// Postgres crash rewound the slot past the window). The position skips it.
	if code := p.stop(); code != 0 {
		t.Fatalf("jetbox exit %d", code)
	}
	f.pg.Exec(t, `DELETE FROM inbox`)
	first, err := stream.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	late := nats.NewMsg(first.Subject)
	late.Data = first.Data
	for k, v := range first.Header {
		if !strings.HasPrefix(k, "Nats-Expected-") {
			late.Header[k] = v
		}
	}
	testenv.WaitFor(t, time.Minute, func() error {
		ack, err := f.js.PublishMsg(ctx, late)
		if err != nil {
			return err
		}
		if ack.Duplicate {
			return errors.New("still inside the duplicate window")
		}
		return nil
	})
	testenv.WaitFor(t, time.Minute, ackedThrough(lastSeq()))
	if got := b.stale.Load() + c.stale.Load(); got != 1 {
		t.Fatalf("%d messages skipped by position, want 1 (the late copy)", got)
	}

	// 5. A new WAL history (a restored or promoted primary, a repair after a
	// lost slot): positions compare only within one Jetbox-Source, so an event
	// of another source at a lower position is applied.
	other := nats.NewMsg(first.Subject)
	other.Data = first.Data
	for k, v := range late.Header {
		other.Header[k] = append([]string(nil), v...)
	}
	other.Header.Set(jetstream.MsgIDHeader, "new-history-1")
	other.Header.Set("Jetbox-Source", "7000000000000000001/2/postgres/jetbox")
	other.Header.Set("Jetbox-Commit-LSN", "0/1")
	if ack, err := f.js.PublishMsg(ctx, other); err != nil || ack.Duplicate {
		t.Fatalf("publish an event of another source: %v (ack %+v)", err, ack)
	}
	committed++
	testenv.WaitFor(t, time.Minute, ackedThrough(lastSeq()))
	if n := query(`SELECT count(*) FROM ledger WHERE msg_id = 'new-history-1'`); n != 1 {
		t.Fatalf("the event of another source applied %d times, want 1", n)
	}

	// Every side effect once, in stream order: the ledger is the stream's
	// first copies, without the dead letter.
	var want []string
	seen := map[string]bool{}
	for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", false) {
		if !seen[m.ID] && m.ID != poisonID {
			want = append(want, m.ID)
		}
		seen[m.ID] = true
	}
	if len(want) != committed-1 {
		t.Fatalf("the stream holds %d distinct ids besides the poison message, %d committed", len(want), committed-1)
	}
	rows, err := f.conn().Query(ctx, `SELECT msg_id FROM ledger ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("ledger (%d rows) is not the stream's events once each in stream order (%d):\nledger %v\nstream %v", len(got), len(want), got, want)
	}
	if applied := a.applied.Load() + b.applied.Load() + c.applied.Load(); applied != int64(len(want)) {
		t.Fatalf("instances applied %d messages, the ledger holds %d", applied, len(want))
	}
	t.Logf("%d events applied once each in stream order; duplicates %d, stale %d, failed attempts %d, slow %s, dead letter %s",
		len(want), b.duplicates.Load()+c.duplicates.Load(), b.stale.Load()+c.stale.Load(), b.failed.Load()+c.failed.Load(), slowID, poisonID)
}
