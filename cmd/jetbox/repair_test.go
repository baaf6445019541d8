package main

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// repair runs jetbox repair to its end and wants exit 0.
func (f *fixture) repair(extra ...string) *proc {
	f.t.Helper()
	p := f.startCmd([]string{"repair"}, append([]string{"JETBOX_REPAIR_PROGRESS_INTERVAL=1s"}, extra...)...)
	if code := p.wait(15 * time.Minute); code != 0 {
		f.t.Fatalf("jetbox repair exited with %d:\n%s", code, p.tail(4096))
	}
	return p
}

var repairDone = regexp.MustCompile(`done: (\d+) rows published, (\d+) already in the stream, in (\S+) \((\d+) rows/s\)`)

// repairRate returns the published count and rate a finished repair printed.
func repairRate(t testing.TB, p *proc) (published, rate int) {
	t.Helper()
	m := repairDone.FindStringSubmatch(p.logText())
	if m == nil {
		t.Fatalf("no summary line in the repair output:\n%s", p.tail(4096))
	}
	published, _ = strconv.Atoi(m[1])
	rate, _ = strconv.Atoi(m[4])
	return published, rate
}

// The repair order keys: created_at, or the commit timestamp when
// track_commit_timestamp is on.
const (
	keyCreatedAt = "created_at"
	keyCommitTS  = "coalesce(pg_xact_commit_timestamp(xmin), created_at)"
)

// rowKeys returns each outbox row's order key (microseconds) by id.
func (f *fixture) rowKeys(key string) map[string]int64 {
	f.t.Helper()
	rows, err := f.conn().Query(ctxT(f.t, time.Minute), `SELECT id::text, (extract(epoch FROM `+key+`) * 1000000)::bigint FROM outbox`)
	must(f.t, err)
	keys := map[string]int64{}
	for rows.Next() {
		var id string
		var us int64
		must(f.t, rows.Scan(&id, &us))
		keys[id] = us
	}
	must(f.t, rows.Err())
	return keys
}

// assertRepaired checks the stream against the committed rows (want, in
// commit order): every row once; the rows jetbox run streamed in commit
// order; each stretch of repaired messages in the repair order (key, then
// id) at one position per repair (Jetbox-Commit-LSN, Tx-Index 0, 1,
// ...) with no overlap with what surrounds it: every row before it was
// committed before every row of it, every row after it after. It returns
// the number of repaired messages.
func (f *fixture) assertRepaired(want []string, key string) int {
	f.t.Helper()
	return f.assertRepairedMsgs(testenv.ReadStream(f.t, f.js, "OUTBOX", true), want, key)
}

// assertRepairedMsgs is assertRepaired on the messages got (the stream's,
// or a part of them).
func (f *fixture) assertRepairedMsgs(got []testenv.StreamMsg, want []string, key string) int {
	f.t.Helper()
	t := f.t
	idx := make(map[string]int, len(want))
	for i, id := range want {
		idx[id] = i
	}
	seen := map[string]bool{}
	for _, m := range got {
		if seen[m.ID] {
			t.Fatalf("id %s stored twice; %s", m.ID, f.describeExtra())
		}
		seen[m.ID] = true
		if _, ok := idx[m.ID]; !ok {
			t.Fatalf("stream holds id %s, which was never committed", m.ID)
		}
	}
	for _, id := range want {
		if !seen[id] {
			t.Fatalf("id %s missing from the stream (%d stored, %d committed)", id, len(got), len(want))
		}
	}
	keys := f.rowKeys(key)
	repaired, lastStreamed := 0, -1
	for i := 0; i < len(got); {
		if got[i].Header.Get("Jetbox-Repaired") != "true" {
			if j := idx[got[i].ID]; j < lastStreamed {
				t.Fatalf("streamed id %s (seq %d) out of commit order", got[i].ID, got[i].Seq)
			} else {
				lastStreamed = j
			}
			i++
			continue
		}
		// A stretch of repaired messages (one or more repairs in a row).
		start := i
		minIdx, maxIdx := len(want), -1
		for ; i < len(got) && got[i].Header.Get("Jetbox-Repaired") == "true"; i++ {
			m := got[i]
			minIdx, maxIdx = min(minIdx, idx[m.ID]), max(maxIdx, idx[m.ID])
			if i > start {
				p := got[i-1]
				pl, _ := pglogrepl.ParseLSN(p.Header.Get("Jetbox-Commit-LSN"))
				ml, _ := pglogrepl.ParseLSN(m.Header.Get("Jetbox-Commit-LSN"))
				pi, _ := strconv.Atoi(p.Header.Get("Jetbox-Tx-Index"))
				mi, _ := strconv.Atoi(m.Header.Get("Jetbox-Tx-Index"))
				if !(ml == pl && mi == pi+1) && !(ml > pl && mi == 0) {
					t.Fatalf("repaired seq %d at position %s/%d after %s/%d: positions must increase (one commit LSN per repair, tx index 0, 1, ...)", m.Seq, ml, mi, pl, pi)
				}
				if ml == pl && (keys[m.ID] < keys[p.ID] || (keys[m.ID] == keys[p.ID] && m.ID < p.ID)) {
					t.Fatalf("repaired seq %d (id %s) before seq %d (id %s) in the repair order (%s, id)", p.Seq, p.ID, m.Seq, m.ID, key)
				}
			}
		}
		if minIdx <= lastStreamed {
			t.Fatalf("repaired rows (seq %d-%d) overlap what was streamed before them", got[start].Seq, got[i-1].Seq)
		}
		if i < len(got) {
			if j := idx[got[i].ID]; j < maxIdx {
				t.Fatalf("id %s streamed after the repair (seq %d) was committed before a repaired row: the slot and the snapshot overlap", got[i].ID, got[i].Seq)
			}
			nl, _ := pglogrepl.ParseLSN(got[i].Header.Get("Jetbox-Commit-LSN"))
			rl, _ := pglogrepl.ParseLSN(got[i-1].Header.Get("Jetbox-Commit-LSN"))
			if nl <= rl {
				t.Fatalf("first streamed event after the repair at commit LSN %s, not after the repaired position %s", nl, rl)
			}
			if got[i].Header.Get("Jetbox-Source") != got[i-1].Header.Get("Jetbox-Source") {
				t.Fatalf("repaired messages carry source %q, the slot's events %q", got[i-1].Header.Get("Jetbox-Source"), got[i].Header.Get("Jetbox-Source"))
			}
		}
		lastStreamed = maxIdx
		repaired += i - start
	}
	return repaired
}

// backfill inserts n rows in transactions of 5,000 before jetbox ever ran.
func (f *fixture) backfill(n int) {
	f.t.Helper()
	conn := f.conn()
	for done := 0; done < n; done += 5000 {
		f.insertTx(conn, fmt.Sprintf("b%d", done), min(5000, n-done))
	}
}

// TestRepairBackfill: a table holds 100,000 rows before the first start;
// jetbox repair, then jetbox run, while writers commit all along. Every row
// once, none lost or doubled at the boundary, the repaired part in the
// repair order and the rest in commit order. Logs the repair rate.
func TestRepairBackfill(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	runsBeside(t)
	rows := envInt("JETBOX_REPAIR_ROWS", 100_000)
	for _, mode := range []string{"exactly-once", "dedup"} {
		t.Run(mode, func(t *testing.T) {
			f := newFixture(t)
			f.env = append(f.env, "JETBOX_DELIVERY="+mode)
			o := f.newOracle()
			f.backfill(rows)
			l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
			t.Cleanup(l.stop)
			rp := f.repair()
			published, rate := repairRate(t, rp)
			if !strings.Contains(rp.logText(), "rows/s, about") {
				t.Fatalf("no progress line on stderr:\n%s", rp.tail(4096))
			}
			t.Logf("repair (%s): %d rows published at %d rows/s, with 2 writers committing meanwhile", mode, published, rate)
			if published < rows {
				t.Fatalf("repair published %d rows, the table held %d before it", published, rows)
			}
			p := f.start()
			f.waitStreaming(p)
			f.progress(uint64(published), time.Minute) // the slot's rows arrive too
			l.stop()
			want := o.ids()
			f.waitCount(len(want), 3*time.Minute)
			n := f.assertRepaired(want, keyCreatedAt)
			if n != published {
				t.Fatalf("%d repaired messages in the stream, the repair published %d", n, published)
			}
			t.Logf("%d rows: %d repaired, %d streamed, each once, no gap or overlap at the boundary", len(want), n, len(want)-n)
			if code := p.stop(); code != 0 {
				t.Fatalf("jetbox run exited with %d", code)
			}
		})
	}
}

// TestRepairLostSlot: jetbox streams some rows, is stopped, the slot is
// dropped, more rows are written; a dry run reports them and publishes
// nothing; jetbox repair, then jetbox run: every row once, in order.
func TestRepairLostSlot(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	runsBeside(t)
	for _, tc := range []struct {
		name, mode, key string
		opts            []fixtureOption
		env             []string
	}{
		{"exactly-once", "exactly-once", keyCreatedAt, nil, nil},
		{"dedup", "dedup", keyCreatedAt, nil, nil},
		{"commit-timestamps", "exactly-once", keyCommitTS, []fixtureOption{withPG(testenv.WithSetting("track_commit_timestamp", "on"))}, nil},
		{"atomic", "exactly-once", keyCreatedAt, nil, []string{"JETBOX_ATOMIC_TRANSACTIONS=true"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.opts...)
			f.env = append(append(f.env, "JETBOX_DELIVERY="+tc.mode), tc.env...)
			o := f.newOracle()
			conn := f.conn()
			p := f.start()
			f.waitStreaming(p)
			for i := 0; i < 3; i++ {
				f.insertTx(conn, fmt.Sprintf("a%d", i), 10)
			}
			f.waitCount(30, time.Minute)
			if code := p.stop(); code != 0 {
				t.Fatalf("jetbox run exited with %d", code)
			}
			testenv.WaitFor(t, 30*time.Second, func() error { // the walsender may outlive jetbox by a moment
				_, err := conn.Exec(ctxT(t, 10*time.Second), "SELECT pg_drop_replication_slot('jetbox')")
				return err
			})
			var lost []string
			for i := 0; i < 5; i++ {
				lost = append(lost, f.insertTx(conn, fmt.Sprintf("l%d", i), 10)...)
			}

			dry := f.startCmd([]string{"repair", "--dry-run"})
			if code := dry.wait(5 * time.Minute); code != 0 {
				t.Fatalf("dry run exited with %d:\n%s", code, dry.tail(4096))
			}
			if out := dry.logText(); !strings.Contains(out, "missing:  50 rows") {
				t.Fatalf("dry run does not report the 50 missing rows:\n%s", out)
			}
			t.Logf("dry run:\n%s", dry.logText())
			if n, err := testenv.StreamCount(f.js, "OUTBOX"); err != nil || n != 30 {
				t.Fatalf("after the dry run the stream holds %d messages (%v), want 30", n, err)
			}
			var slots int
			must(t, conn.QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'jetbox%'").Scan(&slots))
			if slots != 0 {
				t.Fatalf("the dry run created %d slots", slots)
			}

			rp := f.repair()
			if published, _ := repairRate(t, rp); published != 50 {
				t.Fatalf("repair published %d rows, 50 were lost", published)
			}
			var version int
			var failover bool
			must(t, conn.QueryRow(ctxT(t, 10*time.Second), `SELECT current_setting('server_version_num')::int,
				coalesce((SELECT (to_jsonb(s) ->> 'failover')::bool FROM pg_replication_slots s WHERE slot_name = 'jetbox'), false)`).Scan(&version, &failover))
			if version >= 170000 && !failover {
				t.Fatal("on PostgreSQL 17+ repair must create a failover slot, as jetbox run does")
			}
			p = f.start()
			f.waitStreaming(p)
			for i := 0; i < 2; i++ {
				f.insertTx(conn, fmt.Sprintf("c%d", i), 10)
			}
			want := o.ids()
			f.waitCount(len(want), time.Minute)
			if n := f.assertRepaired(want, tc.key); n != len(lost) {
				t.Fatalf("%d repaired messages, %d rows were lost", n, len(lost))
			}
			if tc.env != nil {
				for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", true) {
					if m.Header.Get("Jetbox-Repaired") == "true" && m.Header.Get("Jetbox-Tx-Last") != "true" {
						t.Fatalf("repaired seq %d lacks Jetbox-Tx-Last with --atomic-transactions", m.Seq)
					}
				}
			}
			if code := p.stop(); code != 0 {
				t.Fatalf("jetbox run exited with %d", code)
			}
		})
	}
}

// TestRepairKilled: jetbox repair is SIGKILLed when the stream holds about
// half the rows; jetbox run then refuses to start; a second repair finishes
// (dropping the half-done slot), then jetbox run: every row once.
func TestRepairKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	runsBeside(t)
	rows := envInt("JETBOX_REPAIR_ROWS", 100_000)
	for _, mode := range []string{"exactly-once", "dedup"} {
		t.Run(mode, func(t *testing.T) {
			f := newFixture(t)
			// A small window: the second repair must skip the first one's
			// rows by their ids, not rely on dedup.
			f.env = append(f.env, "JETBOX_DELIVERY="+mode, "JETBOX_DUPLICATE_WINDOW=1s")
			o := f.newOracle()
			f.backfill(rows)
			l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
			t.Cleanup(l.stop)
			rp := f.startCmd([]string{"repair"})
			testenv.WaitFor(t, 10*time.Minute, func() error {
				select {
				case <-rp.done:
					t.Fatalf("repair exited with %d before it was killed:\n%s", rp.code, rp.tail(4096))
				default:
				}
				n, err := testenv.StreamCount(f.js, "OUTBOX")
				if err == nil && n < uint64(rows/2) {
					err = fmt.Errorf("stream holds %d of %d rows", n, rows)
				}
				return err
			})
			rp.kill()
			half, _ := testenv.StreamCount(f.js, "OUTBOX")
			t.Logf("repair killed with %d messages in the stream", half)

			run := f.startCmd([]string{"run"})
			if code := run.wait(2 * time.Minute); code != exitConfig || !strings.Contains(run.logText(), "jetbox repair again") {
				t.Fatalf("jetbox run after an interrupted repair exited with %d, want %d naming the repair:\n%s", code, exitConfig, run.tail(4096))
			}
			time.Sleep(1500 * time.Millisecond) // let the duplicate window pass: the hazard under test
			rp = f.repair()
			published, _ := repairRate(t, rp)
			p := f.start()
			f.waitStreaming(p)
			f.progress(uint64(int(half)+published), time.Minute)
			l.stop()
			want := o.ids()
			f.waitCount(len(want), 3*time.Minute)
			n := f.assertRepaired(want, keyCreatedAt)
			t.Logf("%d rows: %d repaired in two repairs (%d by the second), %d streamed, each once", len(want), n, published, len(want)-n)
			if code := p.stop(); code != 0 {
				t.Fatalf("jetbox run exited with %d", code)
			}
		})
	}
}

// TestRepairRefusesLiveSlot: repair leaves a slot alone that jetbox run
// holds, or that is valid and was not left by a repair (exit 2 with the
// fix), and publishes nothing.
func TestRepairRefusesLiveSlot(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	f := newFixture(t)
	f.env = append(f.env, exactlyOnce)
	p := f.start()
	f.waitStreaming(p)
	f.insertTx(f.conn(), "a", 10)
	f.waitCount(10, time.Minute)
	for _, c := range []struct{ when, want string }{{"while jetbox run streams", "is in use by walsender pid"}, {"after it stopped", "exists, is valid"}} {
		rp := f.startCmd([]string{"repair"})
		if code := rp.wait(2 * time.Minute); code != exitConfig || !strings.Contains(rp.logText(), c.want) {
			t.Fatalf("repair %s exited with %d, want %d and %q:\n%s", c.when, code, exitConfig, c.want, rp.tail(4096))
		}
		if c.when == "while jetbox run streams" {
			if code := p.stop(); code != 0 {
				t.Fatalf("jetbox run exited with %d", code)
			}
			testenv.WaitFor(t, 30*time.Second, func() error {
				if _, active, err := f.slotState(); err != nil || active {
					return fmt.Errorf("slot still active (%v)", err)
				}
				return nil
			})
		}
	}
	if n, err := testenv.StreamCount(f.js, "OUTBOX"); err != nil || n != 10 {
		t.Fatalf("stream holds %d messages (%v), want 10", n, err)
	}
	var markers int
	must(t, f.conn().QueryRow(ctxT(t, 10*time.Second), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'jetbox_repair_jetbox'").Scan(&markers))
	if markers != 0 {
		t.Fatal("a refused repair left its marker: jetbox run would refuse to start")
	}
}

// TestRepairConfigProblems: repair's own flags are checked with run's, all
// reported at once (exit 2), before anything is contacted.
func TestRepairConfigProblems(t *testing.T) {
	var out, errOut strings.Builder
	code := realMain([]string{"repair", "--postgres-url=postgres://u@127.0.0.1:1/db", "--since=yesterday", "--all", "--margin=-1m", "--slot=Bad"}, &out, &errOut)
	if code != exitConfig {
		t.Fatalf("exit %d, want %d:\n%s", code, exitConfig, errOut.String())
	}
	for _, want := range []string{"4 configuration problem(s)", "--since", "--all", "--margin", "--slot"} {
		if !strings.Contains(errOut.String(), want) {
			t.Fatalf("missing %q in:\n%s", want, errOut.String())
		}
	}
}

// TestRepairInvalidRow: a row that cannot be published stops the repair
// (exit 1 naming it, marker kept) or, with --on-invalid=dead-letter,
// becomes the same dead letter jetbox run would publish.
func TestRepairInvalidRow(t *testing.T) {
	if testing.Short() {
		t.Skip("real servers")
	}
	f := newFixture(t)
	f.env = append(f.env, exactlyOnce)
	conn := f.conn()
	good := f.insertTx(conn, "a", 5)
	var bad string
	must(t, conn.QueryRow(ctxT(t, 10*time.Second), `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('big order', '1', 'E', '{}') RETURNING id::text`).Scan(&bad))
	rp := f.startCmd([]string{"repair"})
	if code := rp.wait(2 * time.Minute); code != exitFailure || !strings.Contains(rp.logText(), "id="+bad) || !strings.Contains(rp.logText(), "--on-invalid=dead-letter") {
		t.Fatalf("repair over an invalid row exited with %d, want %d naming the row and the fix:\n%s", code, exitFailure, rp.tail(4096))
	}
	// The rows before it (in the repair order) are stored: the second
	// repair skips them and publishes the dead letter.
	rp = f.repair("JETBOX_ON_INVALID=dead-letter")
	if published, _ := repairRate(t, rp); published != 1 || !strings.Contains(rp.logText(), "5 already in the stream") {
		t.Fatalf("second repair published %d, want the dead letter only:\n%s", published, rp.tail(2048))
	}
	got := testenv.ReadStream(t, f.js, "OUTBOX", true)
	var ids []string
	var dl *testenv.StreamMsg
	for i, m := range got {
		if m.Header.Get("Jetbox-Repaired") != "true" {
			t.Fatalf("seq %d lacks Jetbox-Repaired", m.Seq)
		}
		if strings.HasPrefix(m.Subject, "outbox._dlq.") {
			dl = &got[i]
			continue
		}
		ids = append(ids, m.ID)
	}
	if len(ids) != len(good) || dl == nil || dl.Subject != "outbox._dlq.bad-subject" || dl.Header.Get("Jetbox-Row-Id") != bad {
		t.Fatalf("stream: %d rows (want %d) and dead letter %+v", len(ids), len(good), dl)
	}
	// Nothing is missing now: a second repair (the slot is valid) refuses.
	if code := f.startCmd([]string{"repair"}).wait(time.Minute); code != exitConfig {
		t.Fatalf("second repair exited with %d, want %d", code, exitConfig)
	}
}

// TestRepairResumedWithoutOrderKey: a table without a created-at column,
// track_commit_timestamp turned on after most rows were committed (they
// have no commit timestamp: no order key, they come first). A repair of the
// whole table is killed while it publishes them, and run again: the re-run
// must cover the interrupted repair's own range (the whole table), not a
// guess from the last stored row's time (the zero time: the rest of the
// rows without a key would never be published, and the re-run says done).
func TestRepairResumedWithoutOrderKey(t *testing.T) {
	noCreatedAt := strings.Replace(outboxDDL, ",\n  created_at     timestamptz NOT NULL DEFAULT now()", "", 1)
	if noCreatedAt == outboxDDL {
		t.Fatal("the outbox DDL changed: update this test")
	}
	f := newFixture(t, withDDL(noCreatedAt))
	// One row in flight: slow enough to kill the repair half-way.
	f.env = append(f.env, "JETBOX_MAX_IN_FLIGHT=1")
	conn := f.conn()
	var want []string
	for len(want) < 6000 {
		want = append(want, f.insertTx(conn, "old", 2000)...)
	}
	conn.Close(ctxT(t, 5*time.Second))
	f.pg.Exec(t, "ALTER SYSTEM SET track_commit_timestamp = on")
	f.pg.Restart("fast")
	conn = f.conn()
	want = append(want, f.insertTx(conn, "new", 3)...)

	rp := f.startCmd([]string{"repair"})
	testenv.WaitFor(t, 2*time.Minute, func() error {
		select {
		case <-rp.done:
			t.Fatalf("repair exited with %d before it was killed:\n%s", rp.code, rp.tail(4096))
		default:
		}
		n, err := testenv.StreamCount(f.js, "OUTBOX")
		if err == nil && n < 200 {
			err = fmt.Errorf("stream holds %d rows", n)
		}
		return err
	})
	rp.kill()
	half, _ := testenv.StreamCount(f.js, "OUTBOX")
	if half >= uint64(len(want)) {
		t.Fatalf("the repair finished (%d messages) before it was killed", half)
	}
	last := testenv.ReadStream(t, f.js, "OUTBOX", true)[half-1]
	if got := last.Header.Get("Jetbox-Commit-Time"); !strings.HasPrefix(got, "0001-01-01") {
		t.Fatalf("the last stored row has commit time %q: want a row without an order key", got)
	}
	rp = f.repair()
	f.assertRepaired(want, "coalesce(pg_xact_commit_timestamp(xmin), '0001-01-01 00:00:00+00'::timestamptz)") // no key first
	if !strings.Contains(rp.logText(), "repairing its range again") {
		t.Fatalf("the re-run did not say it resumed the interrupted repair's range:\n%s", rp.tail(4096))
	}
}
