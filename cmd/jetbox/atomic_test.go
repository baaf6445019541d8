package main

import (
	"bytes"
	"context"
	"fmt"
	"math/rand"
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

const atomicTx = "JETBOX_ATOMIC_TRANSACTIONS=true"

// txLasts returns, from the oracle slot, the ids that are the last outbox
// row of their transaction.
func (o *oracle) txLasts() map[string]bool {
	o.f.t.Helper()
	rows, err := o.f.conn().Query(ctxT(o.f.t, 5*time.Minute), "SELECT data FROM pg_logical_slot_peek_changes('oracle', NULL, NULL)")
	must(o.f.t, err)
	defer rows.Close()
	lasts, prev := map[string]bool{}, ""
	for rows.Next() {
		var line string
		must(o.f.t, rows.Scan(&line))
		if m := oracleID.FindStringSubmatch(line); m != nil {
			prev = m[1]
		} else if strings.HasPrefix(line, "COMMIT") && prev != "" {
			lasts[prev], prev = true, ""
		}
	}
	must(o.f.t, rows.Err())
	return lasts
}

// assertTransactions checks the stream against the oracle's transactions:
// Jetbox-Tx-Last is "true" exactly on the last row of each, and an atomic
// batch ends only at a transaction's end, or where cut allows it (given the
// batch's last message). It returns the batch sizes in stream order.
func assertTransactions(t *testing.T, msgs []testenv.StreamMsg, lasts map[string]bool, cut func(end testenv.StreamMsg) bool) (batches []int) {
	t.Helper()
	n := 0
	for i, m := range msgs {
		if got := m.Header.Get("Jetbox-Tx-Last") == "true"; got != lasts[m.ID] {
			t.Fatalf("seq %d (id %s): Jetbox-Tx-Last %v, but it is %sthe last row of its transaction", m.Seq, m.ID, got, map[bool]string{true: "", false: "not "}[lasts[m.ID]])
		}
		if m.Header.Get("Nats-Batch-Id") == "" {
			t.Fatalf("seq %d was not stored by an atomic batch", m.Seq)
		}
		n++
		if i == len(msgs)-1 || msgs[i+1].Header.Get("Nats-Batch-Id") != m.Header.Get("Nats-Batch-Id") {
			if !lasts[m.ID] && (cut == nil || !cut(m)) {
				t.Fatalf("an atomic batch of %d ends at seq %d (id %s), inside a transaction", n, m.Seq, m.ID)
			}
			batches = append(batches, n)
			n = 0
		}
	}
	return batches
}

// TestAtomicKillLoop: transactions of 1 to 900 rows, jetbox SIGKILLed
// repeatedly while it publishes them, and a watcher that reads the stream's
// last message at random moments: it is always the last row of a
// transaction (no transaction is ever partly stored). At the end the stream
// holds every committed row once, in commit order, and atomic batches end
// only at transaction ends.
//
// The watcher reads with the message-get API, which JetStream isolates from
// a batch being applied; stream info is not isolated (its last sequence
// can be inside a batch for the microseconds the batch takes to apply), so
// those reads are only counted.
func TestAtomicKillLoop(t *testing.T) {
	runsBeside(t)
	f := newFixture(t)
	f.env = append(f.env, exactlyOnce, atomicTx, "JETBOX_LOG_LEVEL=info")
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	var wg sync.WaitGroup
	var rows, txns atomic.Int64
	const maxRows = 60_000
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(time.Now().UnixNano() + int64(w)))
			conn, err := pgx.Connect(ctx, f.pg.DSN)
			if err != nil {
				t.Error(err)
				return
			}
			defer conn.Close(context.Background())
			tick := time.NewTicker(300 * time.Millisecond)
			defer tick.Stop()
			for ctx.Err() == nil && rows.Load() < maxRows {
				n := 1 + rng.Intn(900)
				// Not ctx: a cancelled statement may still commit after the oracle was read.
				sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				_, err := conn.Exec(sctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
					SELECT 'order', $1, 'OrderCreated', jsonb_build_object('writer', $2::int, 'n', g, 'pad', repeat('x', 1000)) FROM generate_series(1, $3) g`,
					fmt.Sprintf("w%d", w), w, n)
				cancel()
				if err != nil {
					t.Errorf("writer %d: %v", w, err)
					return
				}
				rows.Add(int64(n))
				txns.Add(1)
				select {
				case <-ctx.Done():
				case <-tick.C:
				}
			}
		}(w)
	}

	// The watcher.
	var seen, infoInside atomic.Int64
	var bad atomic.Value
	lastIDs := make(chan string, 100_000)
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewSource(time.Now().UnixNano()))
		for ctx.Err() == nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Duration(rng.Intn(10_000)) * time.Microsecond): // a random moment
			}
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			st, err := f.js.Stream(rctx, "OUTBOX")
			if err == nil {
				var m *jetstream.RawStreamMsg
				if m, err = st.GetLastMsgForSubject(rctx, ">"); err == nil {
					seen.Add(1)
					if m.Header.Get("Jetbox-Tx-Last") != "true" {
						bad.Store(fmt.Sprintf("the stream's last message, seq %d (id %s, row %s of transaction %s), is not the last of its transaction",
							m.Sequence, m.Header.Get("Nats-Msg-Id"), m.Header.Get("Jetbox-Tx-Index"), m.Header.Get("Jetbox-Commit-LSN")))
					}
					select {
					case lastIDs <- m.Header.Get("Nats-Msg-Id"):
					default:
					}
				}
				if last := st.CachedInfo().State.LastSeq; err == nil && last > 0 {
					if im, err := st.GetMsg(rctx, last); err == nil && im.Header.Get("Jetbox-Tx-Last") != "true" {
						infoInside.Add(1)
					}
				}
			}
			cancel()
		}
	}()

	// A batch whose commit never came (jetbox died while sending it) is
	// dropped by the server after its batch timeout, with an advisory.
	var abandoned atomic.Int64
	nc, _ := f.nats.Connect(t)
	sub, err := nc.Subscribe("$JS.EVENT.ADVISORY.STREAM.BATCH_ABANDONED.OUTBOX", func(*nats.Msg) { abandoned.Add(1) })
	must(t, err)
	defer func() { _ = sub.Unsubscribe() }()

	// Core subscribers see a batch's messages as jetbox sends them: every
	// other kill comes the moment a batch of several messages starts.
	batchStarts := make(chan struct{}, 1)
	bsub, err := nc.Subscribe("outbox.>", func(m *nats.Msg) {
		if m.Header.Get("Nats-Batch-Sequence") == "1" && m.Header.Get("Nats-Batch-Commit") == "" {
			select {
			case batchStarts <- struct{}{}:
			default:
			}
		}
	})
	must(t, err)
	defer func() { _ = bsub.Unsubscribe() }()

	kills, began := 0, time.Now()
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	var count uint64
	for kills < 10 && time.Since(began) < 60*time.Second {
		count = f.progress(count, time.Minute)
		if kills%2 == 0 {
			time.Sleep(time.Duration(rng.Intn(400)) * time.Millisecond) // a random moment, not synchronisation
		} else {
			select {
			case <-batchStarts: // drop a stale signal, then wait for the next batch
			default:
			}
			select {
			case <-batchStarts:
			case <-time.After(10 * time.Second):
			}
		}
		p.kill()
		kills++
		p = f.start()
	}
	for rows.Load() < maxRows && ctx.Err() == nil && time.Since(began) < 90*time.Second {
		count = f.progress(count, time.Minute) // let the writers finish while jetbox runs
	}
	want := waitWriters(t, stop, &wg, o)
	f.waitCount(len(want), 2*time.Minute)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	assertIDs(t, msgs, want)
	lasts := o.txLasts()
	batches := assertTransactions(t, msgs, lasts, nil)
	if msg, _ := bad.Load().(string); msg != "" {
		t.Fatal("watcher: " + msg)
	}
	close(lastIDs)
	for id := range lastIDs {
		if !lasts[id] {
			t.Fatalf("watcher saw id %s as the stream's last message: it is not the last row of its transaction", id)
		}
	}
	if seen.Load() < 20 {
		t.Fatalf("the watcher read the stream only %d times", seen.Load())
	}
	t.Logf("%d kills in %s; %d rows in %d transactions stored once, in commit order, in %d atomic batches; watcher: %d reads, the last message always ended a transaction (stream info's last sequence was inside a batch being applied %d times); %d batches abandoned by a kill so far (server advisories)",
		kills, time.Since(began).Round(time.Second), len(want), txns.Load(), len(batches), seen.Load(), infoInside.Load(), abandoned.Load())
	if code := p.stop(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}
}

// waitWriters stops the writers and the watcher, and returns the committed
// ids in commit order.
func waitWriters(t *testing.T, stop context.CancelFunc, wg *sync.WaitGroup, o *oracle) []string {
	t.Helper()
	stop()
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	return o.ids()
}

// TestAtomicBigTransaction: a transaction of 5,000 rows arrives whole in
// atomic chunks, only its last message marked. With the default window the
// chunks are the server's batch limit (1,000); with a byte window smaller
// than the transaction the window cuts it, and the 100-row transactions
// around it, which fit the window, are still stored whole.
func TestAtomicBigTransaction(t *testing.T) {
	for _, c := range []struct {
		name string
		env  []string
	}{
		{"default window", nil},
		{"byte window 64KiB", []string{"JETBOX_MAX_IN_FLIGHT_BYTES=64KiB"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			f.env = append(append(f.env, exactlyOnce, atomicTx, "JETBOX_LOG_LEVEL=info"), c.env...)
			o := f.newOracle()
			p := f.start()
			f.waitStreaming(p)
			conn := f.conn()
			small := c.env != nil
			if small {
				for i := 0; i < 10; i++ {
					f.insertTx(conn, fmt.Sprint("before-", i), 100)
				}
			}
			big := f.insertTx(conn, "big", 5000)
			if small {
				for i := 0; i < 10; i++ {
					f.insertTx(conn, fmt.Sprint("after-", i), 100)
				}
			}
			want := o.ids()
			f.waitCount(len(want), 2*time.Minute)
			msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
			assertIDs(t, msgs, want)
			inBig := map[string]bool{}
			for _, id := range big {
				inBig[id] = true
			}
			var chunks []int
			batches := assertTransactions(t, msgs, o.txLasts(), func(end testenv.StreamMsg) bool { return inBig[end.ID] })
			// A batch holds whole sealed units: the big transaction's last
			// chunk may share one with the small transactions after it.
			start := 0
			for _, n := range batches {
				if n > 1000 {
					t.Fatalf("a batch of %d rows", n)
				}
				own := 0
				for _, m := range msgs[start : start+n] {
					if inBig[m.ID] {
						own++
					}
				}
				if own > 0 {
					chunks = append(chunks, own)
				}
				start += n
			}
			sum := 0
			for _, n := range chunks {
				sum += n
			}
			if sum != 5000 || len(chunks) < 5 {
				t.Fatalf("the big transaction went in chunks %v", chunks)
			}
			if !small && fmt.Sprint(chunks) != "[1000 1000 1000 1000 1000]" {
				t.Fatalf("chunks %v, want five of 1000 (the server's batch limit)", chunks)
			}
			info, err := f.js.Stream(ctxT(t, 5*time.Second), "OUTBOX")
			must(t, err)
			if !info.CachedInfo().Config.AllowAtomicPublish {
				t.Fatal("jetbox created the stream without atomic publish")
			}
			t.Logf("5,000-row transaction stored in %d atomic chunks %v; %d batches in all", len(chunks), chunks, len(batches))
			if code := p.stop(); code != 0 {
				t.Fatalf("exit code %d after SIGTERM", code)
			}
		})
	}
}

// TestAtomicConfigAndSetup: --atomic-transactions without exactly-once is a
// configuration error; a stream that does not allow atomic publish is a
// set-up error with its fix, from run and from check; once allowed, check
// reports the batch size.
func TestAtomicConfigAndSetup(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--delivery=dedup", "--atomic-transactions=true"}, &out, &errOut); code != exitConfig ||
		!strings.Contains(plainLog(errOut.String()), "--atomic-transactions (JETBOX_ATOMIC_TRANSACTIONS)") || !strings.Contains(plainLog(errOut.String()), "needs --delivery=exactly-once") {
		t.Fatalf("without exactly-once: exit %d:\n%s", code, plainLog(errOut.String()))
	}
	errOut.Reset()
	if code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--atomic-transactions=maybe"}, &out, &errOut); code != exitConfig ||
		!strings.Contains(plainLog(errOut.String()), "not a boolean") {
		t.Fatalf("not a boolean: exit %d:\n%s", code, plainLog(errOut.String()))
	}

	f := newFixture(t)
	_, err := f.js.CreateStream(ctxT(t, 10*time.Second), jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.>"}, Duplicates: 30 * time.Minute})
	must(t, err)
	p := f.start(exactlyOnce, atomicTx)
	if code := p.wait(time.Minute); code != exitConfig {
		t.Fatalf("exit %d, want %d:\n%s", code, exitConfig, p.logText())
	}
	if log := p.logText(); !strings.Contains(log, `stream \"OUTBOX\" does not allow atomic publish`) || !strings.Contains(log, "allow_atomic: true") ||
		!strings.Contains(log, "nats stream edit OUTBOX") {
		t.Fatalf("no clear set-up error:\n%s", log)
	}
	args := []string{"check", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL, "--delivery=exactly-once", "--atomic-transactions=true"}
	out.Reset()
	if code := realMain(args, &out, &errOut); code != exitConfig || !strings.Contains(out.String(), "nats.atomic") ||
		!strings.Contains(out.String(), "does not allow atomic publish") {
		t.Fatalf("check: exit %d:\n%s", code, out.String())
	}

	st, err := f.js.Stream(ctxT(t, 5*time.Second), "OUTBOX")
	must(t, err)
	cfg := st.CachedInfo().Config
	cfg.AllowAtomicPublish = true
	_, err = f.js.UpdateStream(ctxT(t, 5*time.Second), cfg)
	must(t, err)
	out.Reset()
	if code := realMain(args, &out, &errOut); code != exitOK || !strings.Contains(out.String(), "atomic batches of up to 1000 messages") {
		t.Fatalf("check with atomic publish allowed: exit %d:\n%s", code, out.String())
	}
	t.Logf("jetbox check:\n%s", out.String())

	// It runs now; nothing was stored by the checks' probes.
	p = f.start(exactlyOnce, atomicTx)
	f.waitStreaming(p)
	ids := f.insertTx(f.conn(), "a", 3)
	f.waitCount(3, 30*time.Second)
	msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
	if msgs[0].ID != ids[0] || msgs[2].Header.Get("Jetbox-Tx-Last") != "true" || msgs[1].Header.Get("Jetbox-Tx-Last") != "" {
		t.Fatalf("stored %+v", msgs)
	}
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d", code)
	}
}

// TestAtomicNATSRestart: NATS restarts under load (transactions of 1-5
// rows). jetbox republishes what failed without reconnecting to Postgres;
// the transaction it was reading at the failure stays held until its
// commit, so no atomic batch ever ends inside a transaction.
func TestAtomicNATSRestart(t *testing.T) {
	f, o, p, l := underLoad(t, 2, exactlyOnce, atomicTx)
	var count uint64
	for i := 0; i < 3; i++ {
		count = f.progress(count, time.Minute)
		f.nats.Restart()
	}
	f.progress(count, time.Minute)
	f.finish(l, o)
	batches := assertTransactions(t, testenv.ReadStream(t, f.js, "OUTBOX", true), o.txLasts(), nil)
	if !strings.Contains(p.logText(), "republished; resuming") {
		t.Fatalf("jetbox never republished:\n%s", p.tail(3000))
	}
	t.Logf("%d atomic batches, none ends inside a transaction", len(batches))
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d", code)
	}
}

// TestAtomicClusterLeaderKills: atomic transactions on an R3 stream of a
// three-node cluster whose stream leader is killed under load (up to 4
// kills or 45s): every committed row once, in commit order, and no atomic
// batch ends inside a transaction.
func TestAtomicClusterLeaderKills(t *testing.T) {
	runsBeside(t)
	f, c := newClusterFixture(t, true)
	f.env = append(f.env, "JETBOX_PUBLISH_TIMEOUT=3s", exactlyOnce, atomicTx)
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)
	l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
	t.Cleanup(l.stop)
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	begin, kills := time.Now(), 0
	var count uint64
	for kills < 4 && time.Since(begin) < 45*time.Second {
		count = f.progress(count, time.Minute)
		time.Sleep(time.Duration(rng.Intn(300)) * time.Millisecond) // a random moment, not synchronisation
		leader := c.StreamLeader("OUTBOX")
		c.Kill(leader)
		kills++
		count = f.progress(count, time.Minute)
		c.Restart(leader)
		c.WaitStreamCurrent("OUTBOX")
	}
	f.finish(l, o)
	batches := assertTransactions(t, testenv.ReadStream(t, f.js, "OUTBOX", true), o.txLasts(), nil)
	t.Logf("%d leader kills in %s; %d atomic batches, none ends inside a transaction", kills, time.Since(begin).Round(time.Millisecond), len(batches))
	if code := p.stop(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}
}

// TestAtomicLimitLoweredWhileRunning: the stream's max_msg_size is lowered
// under a running jetbox, then a transaction of five rows commits whose
// fourth is over the new limit. JetStream refuses the batch (the session
// read the old limit); jetbox names that row as too-large and never stores
// the transaction in part: with --on-invalid=stop it exits 1 and no row of
// the transaction is in the stream; with --on-invalid=dead-letter the
// transaction is stored whole, in one atomic batch, the dead letter in the
// row's place and the last row marked Jetbox-Tx-Last, each once, in order.
func TestAtomicLimitLoweredWhileRunning(t *testing.T) {
	if testing.Short() {
		t.Skip("end to end: builds and runs jetbox against Postgres and NATS")
	}
	for _, policy := range []string{"stop", "dead-letter"} {
		t.Run(policy, func(t *testing.T) {
			f := newFixture(t)
			f.env = append(f.env, exactlyOnce, atomicTx, "JETBOX_ON_INVALID="+policy)
			p := f.start()
			f.waitStreaming(p)
			conn := f.conn()
			before := f.insertTx(conn, "before", 2)
			f.waitCount(2, time.Minute) // the session is open: it read the stream's limits

			st, err := f.js.Stream(ctxT(t, 10*time.Second), "OUTBOX")
			must(t, err)
			cfg := st.CachedInfo().Config
			cfg.MaxMsgSize = 8 * 1024
			_, err = f.js.UpdateStream(ctxT(t, 10*time.Second), cfg)
			must(t, err)
			rows, err := conn.Query(ctxT(t, time.Minute), `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
				SELECT 'order', 'tx', 'OrderCreated', jsonb_build_object('n', g, 'pad', repeat('x', CASE WHEN g = 4 THEN 20000 ELSE 10 END))
				FROM generate_series(1, 5) g RETURNING id::text`)
			must(t, err)
			ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
			must(t, err)

			if policy == "stop" {
				if code := p.wait(2 * time.Minute); code != exitFailure {
					t.Fatalf("exit %d, want %d:\n%s", code, exitFailure, p.tail(3000))
				}
				for _, want := range []string{ids[3], "too-large", "max_msg_size"} {
					if !strings.Contains(p.logText(), want) {
						t.Fatalf("log lacks %q:\n%s", want, p.tail(3000))
					}
				}
				f.assertStream(before) // nothing of the transaction, not even its first rows
				return
			}
			f.waitCount(7, 2*time.Minute)
			msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
			tx := msgs[2:]
			for i, m := range tx {
				switch {
				case i == 3:
					if m.Subject != "outbox._dlq.too-large" || m.Header.Get("Jetbox-Row-Id") != ids[3] {
						t.Fatalf("seq %d: subject %s, row id %q; want the dead letter of %s", m.Seq, m.Subject, m.Header.Get("Jetbox-Row-Id"), ids[3])
					}
				case m.ID != ids[i]:
					t.Fatalf("seq %d holds %s, want row %d of the transaction (%s)", m.Seq, m.ID, i, ids[i])
				}
				if last := m.Header.Get("Jetbox-Tx-Last") == "true"; last != (i == 4) {
					t.Fatalf("seq %d (row %d of 5): Jetbox-Tx-Last %v", m.Seq, i, last)
				}
				if m.Header.Get("Nats-Batch-Id") != tx[0].Header.Get("Nats-Batch-Id") {
					t.Fatalf("seq %d (row %d of 5) was stored by another atomic batch than row 0", m.Seq, i)
				}
			}
			if msgs[0].ID != before[0] || msgs[1].ID != before[1] {
				t.Fatalf("the first transaction: %s, %s", msgs[0].ID, msgs[1].ID)
			}
			if code := p.stop(); code != exitOK {
				t.Fatalf("exit %d", code)
			}
		})
	}
}
