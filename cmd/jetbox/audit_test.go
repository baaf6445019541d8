package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/audit"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// auditResult is one jetbox audit run.
type auditResult struct {
	code           int
	stdout, stderr string
	elapsed        time.Duration
	maxRSS         int64         // bytes
	cpu            time.Duration // user and system time of the audit
}

// audit runs jetbox audit to its end; extra env entries override.
func (f *fixture) audit(extra ...string) auditResult {
	f.t.Helper()
	return f.auditFor(2*time.Minute, extra...)
}

// auditFor runs jetbox audit, killed after timeout.
func (f *fixture) auditFor(timeout time.Duration, extra ...string) auditResult {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, jetboxBin, "audit")
	cmd.Env = append(append(append(os.Environ(), "JETBOX_POSTGRES_URL="+f.pgURL, "JETBOX_NATS_URL="+f.natURL, "JETBOX_AUDIT_GRACE=0s"), f.env...), extra...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	began := time.Now()
	if err := cmd.Start(); err != nil {
		f.t.Fatalf("jetbox audit: %v", err)
	}
	// The peak resident set, sampled while it runs: the last sample
	// before the exit holds the peak up to 10 ms before it.
	sampled := make(chan int64)
	exited := make(chan struct{})
	go func() {
		peak := int64(0)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			peak = max(peak, vmHWM(cmd.Process.Pid))
			select {
			case <-exited:
				sampled <- peak
				return
			case <-tick.C:
			}
		}
	}()
	err := cmd.Wait()
	elapsed := time.Since(began)
	close(exited)
	rss := <-sampled
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		f.t.Fatalf("jetbox audit: %v", err)
	}
	return auditResult{code, out.String(), errb.String(), elapsed, rss, cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()}
}

// auditJSON runs jetbox audit --json and parses its report.
func (f *fixture) auditJSON(t *testing.T, wantCode int, extra ...string) auditJSON {
	t.Helper()
	r := f.audit(append([]string{"JETBOX_AUDIT_JSON=true"}, extra...)...)
	if r.code != wantCode {
		t.Fatalf("jetbox audit exited with %d, want %d:\n%s\n%s", r.code, wantCode, r.stdout, r.stderr)
	}
	var rep auditJSON
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatalf("audit --json output does not parse: %v:\n%s", err, r.stdout)
	}
	return rep
}

func exampleIDs(k audit.Kind) []string {
	var ids []string
	for _, e := range k.First {
		ids = append(ids, e.ID)
	}
	slices.Sort(ids)
	return ids
}

// TestAudit: rows streamed by jetbox run audit complete; a foreign id is
// reported (a defect only with --strict), a second copy of a row is
// duplicated, messages deleted from the stream are missing with their ids
// and the repair line, and a stream whose limit dropped its first
// messages cannot be judged (exit 2, naming the limit). Rows keyed by
// created_at, and by their commit timestamp.
func TestAudit(t *testing.T) {
	testenv.SkipIfShort(t)
	t.Run("created_at", func(t *testing.T) {
		// The range ends at the last message's commit time minus the
		// margin: 0s, as the test's transactions are instant.
		f := newFixture(t)
		f.env = append(f.env, "JETBOX_AUDIT_MARGIN=0s")
		testAudit(t, f, "created_at, then id")
	})
	t.Run("commit-timestamps", func(t *testing.T) {
		testAudit(t, newFixture(t, withPG(testenv.WithSetting("track_commit_timestamp", "on"))), "commit timestamp (else created_at), then id")
	})
}

func testAudit(t *testing.T, f *fixture, order string) {
	conn := f.conn()
	p := f.start()
	f.waitStreaming(p)
	var ids []string
	for i := 0; i < 3; i++ {
		ids = append(ids, f.insertTx(conn, "a", 100)...)
	}
	f.waitCount(len(ids), time.Minute)
	if code := p.stop(); code != 0 {
		t.Fatalf("jetbox run exited with %d", code)
	}
	ctx := ctxT(t, time.Minute)
	st, err := f.js.Stream(ctx, "OUTBOX")
	must(t, err)
	stored := testenv.ReadStream(t, f.js, "OUTBOX", true)
	commitTime := stored[0].Header.Get("Jetbox-Commit-Time")

	t.Run("complete", func(t *testing.T) {
		r := f.audit()
		if r.code != 0 || !strings.Contains(r.stdout, "rows:           300\n") || !strings.Contains(r.stdout, "result:         complete") {
			t.Fatalf("jetbox audit exited with %d, want 0 with 300 rows, complete:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
		rep := f.auditJSON(t, 0)
		if rep.Result != "complete" || rep.Order != order || rep.Rows != 300 || rep.Messages != 300 || rep.Missing.Count+rep.Duplicated.Count+rep.OutOfOrder.Count+rep.NotInTable.Count != 0 {
			t.Fatalf("report %+v, want order %q, 300 rows and messages, nothing found", rep, order)
		}
	})

	publish := func(id string, h nats.Header) uint64 {
		t.Helper()
		msg := nats.NewMsg("outbox.order.OrderCreated")
		msg.Header = h
		msg.Header.Set(jetstream.MsgIDHeader, id)
		msg.Header.Set("Jetbox-Commit-Time", commitTime)
		ack, err := f.js.PublishMsg(ctx, msg)
		must(t, err)
		return ack.Sequence
	}
	t.Run("not in table", func(t *testing.T) {
		seq := publish("foreign-1", nats.Header{})
		defer func() { must(t, st.DeleteMsg(ctx, seq)) }()
		rep := f.auditJSON(t, 0)
		if rep.NotInTable.Count != 1 || !slices.Equal(exampleIDs(rep.NotInTable), []string{"foreign-1"}) || rep.Missing.Count != 0 {
			t.Fatalf("report %+v, want foreign-1 not in table, nothing missing", rep)
		}
		if rep := f.auditJSON(t, 1, "JETBOX_AUDIT_STRICT=true"); rep.Result != "defects" {
			t.Fatalf("--strict: result %q, want defects", rep.Result)
		}
	})

	t.Run("duplicated", func(t *testing.T) {
		// The row's dead letter besides its message: a second copy.
		seq := publish("copy-of-"+ids[5], nats.Header{"Jetbox-Row-Id": []string{ids[5]}})
		defer func() { must(t, st.DeleteMsg(ctx, seq)) }()
		rep := f.auditJSON(t, 1)
		if rep.Duplicated.Count != 1 || !slices.Equal(exampleIDs(rep.Duplicated), []string{ids[5]}) || rep.Duplicated.First[0].Seq != seq || rep.Missing.Count != 0 {
			t.Fatalf("report %+v, want %s duplicated at seq %d, nothing missing", rep, ids[5], seq)
		}
	})

	t.Run("missing", func(t *testing.T) {
		var want []string
		for _, i := range []int{10, 150, 298} {
			must(t, st.DeleteMsg(ctx, stored[i].Seq))
			want = append(want, stored[i].ID)
		}
		slices.Sort(want)
		rep := f.auditJSON(t, 1)
		if rep.Missing.Count != 3 || !slices.Equal(exampleIDs(rep.Missing), want) || rep.Rows != 300 || rep.Messages != 297 || rep.Duplicated.Count != 0 {
			t.Fatalf("report %+v, want %v missing of 300 rows", rep, want)
		}
		r := f.audit()
		first := rep.Missing.First[0].Time.UTC().Format(time.RFC3339Nano)
		if r.code != 1 || !strings.Contains(r.stdout, "missing:        3\n") || !strings.Contains(r.stdout, "jetbox repair --since "+first) {
			t.Fatalf("jetbox audit exited with %d, want 1, 3 missing and the repair line from %s:\n%s\n%s", r.code, first, r.stdout, r.stderr)
		}
	})

	t.Run("max_msgs dropped the start", func(t *testing.T) {
		info, err := st.Info(ctx)
		must(t, err)
		cfg := info.Config
		cfg.MaxMsgs = 100
		_, err = f.js.UpdateStream(ctx, cfg)
		must(t, err)
		r := f.audit()
		if r.code != 2 || !strings.Contains(r.stderr, "cannot judge the range") || !strings.Contains(r.stderr, "max_msgs 100") || strings.Contains(r.stdout, "missing") {
			t.Fatalf("jetbox audit exited with %d, want 2 naming max_msgs 100, no missing report:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
	})
}

// TestAuditConfig: every configuration problem at once, exit 2, and a
// messages-only source is refused (nothing to compare against).
func TestAuditConfig(t *testing.T) {
	var out, errb bytes.Buffer
	code := realMain([]string{"audit", "--postgres-url=postgres://x/y", "--source=messages", "--since=yesterday", "--grace=soon", "--page-size=0"}, &out, &errb)
	for _, want := range []string{"4 configuration problem(s)", "--source", "nothing to compare against", "--since", "--grace", "--page-size"} {
		if !strings.Contains(errb.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if code != exitConfig {
		t.Errorf("exit %d, want %d", code, exitConfig)
	}
	if t.Failed() {
		t.Log(errb.String())
	}
}

// TestAuditRate measures jetbox audit on JETBOX_AUDIT_ROWS rows (skipped
// when unset; docs/performance.md has the figure for 100,000): rows
// streamed by jetbox run, then one audit, its rate and peak RSS.
func TestAuditRate(t *testing.T) {
	testenv.SkipIfShort(t)
	n := envInt("JETBOX_AUDIT_ROWS", 0)
	if n == 0 {
		t.Skip("set JETBOX_AUDIT_ROWS")
	}
	f := newFixture(t)
	// The stream's duplicate window: jetbox's default (the fixture's 30m
	// keeps every id of the run in the server's memory), or
	// JETBOX_AUDIT_WINDOW.
	p := f.start("JETBOX_LOG_LEVEL=info", "JETBOX_DUPLICATE_WINDOW="+os.Getenv("JETBOX_AUDIT_WINDOW"))
	f.waitStreaming(p)
	f.pg.Exec(t, "CREATE INDEX ON outbox (created_at, id)") // the index jetbox check asks for
	for done := 0; done < n; done += 10_000 {
		f.pg.Exec(t, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
			SELECT 'order', 'o-' || g, 'OrderCreated', jsonb_build_object('n', g) FROM generate_series(1, $1) g`, min(10_000, n-done))
	}
	// Bounds for slow machines: 10,000 rows/s streamed, 10,000 audited.
	bound := max(2*time.Minute, time.Duration(n/10_000)*time.Second)
	f.waitCount(n, max(10*time.Minute, bound))
	if code := p.stop(); code != 0 {
		t.Fatalf("jetbox run exited with %d", code)
	}
	// Margin 0s: the range ends at the last message's commit time minus
	// the margin, and the test's transactions are instant.
	env := append([]string{"JETBOX_AUDIT_MARGIN=0s"}, strings.Fields(os.Getenv("JETBOX_AUDIT_EXTRA"))...)
	// JETBOX_AUDIT_BASELINE_BIN: other jetbox builds, comma-separated,
	// audited beside this one on the same stream and table, interleaved,
	// JETBOX_AUDIT_REPS times (default 1).
	bins := []string{jetboxBin}
	if v := os.Getenv("JETBOX_AUDIT_BASELINE_BIN"); v != "" {
		bins = append(bins, strings.Split(v, ",")...)
	}
	defer func(bin string) { jetboxBin = bin }(jetboxBin)
	for rep := 0; rep < envInt("JETBOX_AUDIT_REPS", 1); rep++ {
		for _, bin := range bins {
			jetboxBin = bin
			nats0, pg0 := selfCPU(t), postgresCPU(t)
			r := f.auditFor(bound, env...)
			// The NATS server is embedded in this test process: its CPU
			// over the audit is this process's (the sampling beside it is
			// a few µs per 10 ms).
			natsCPU, pgCPU := selfCPU(t)-nats0, postgresCPU(t)-pg0
			if r.code != 0 || !strings.Contains(r.stdout, fmt.Sprintf("rows:           %d\n", n)) {
				t.Fatalf("%s audit exited with %d, want 0 with %d rows:\n%s\n%s", bin, r.code, n, r.stdout, r.stderr)
			}
			perRow := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(n) }
			t.Logf("%s: audit of %d rows: %s, %.0f rows/s, peak RSS %.1f MiB, CPU %.2f µs/row (NATS server %.2f, Postgres %.2f)", filepath.Base(bin), n, r.elapsed.Round(time.Millisecond),
				float64(n)/r.elapsed.Seconds(), float64(r.maxRSS)/(1<<20), perRow(r.cpu), perRow(natsCPU), perRow(pgCPU))
		}
	}
}

// selfCPU is this process's user and system time.
func selfCPU(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// postgresCPU is the user and system time of every postgres process on
// the machine, with that of the children they reaped (the backends that
// exited): the test's server is the only one.
func postgresCPU(t *testing.T) time.Duration {
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		t.Fatal(err)
	}
	var ticks int64
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // exited
		}
		s := string(b)
		open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || end < open || s[open+1:end] != "postgres" {
			continue
		}
		// After the command: state (field 3) first; utime, stime,
		// cutime, cstime are fields 14 to 17.
		f := strings.Fields(s[end+1:])
		for _, v := range f[11:15] {
			n, _ := strconv.ParseInt(v, 10, 64)
			ticks += n
		}
	}
	return time.Duration(ticks) * 10 * time.Millisecond // USER_HZ is 100 on Linux
}

// seqOf returns the stream sequence of the message with id.
func seqOf(t *testing.T, f *fixture, id string) uint64 {
	t.Helper()
	for _, m := range testenv.ReadStream(t, f.js, "OUTBOX", true) {
		if m.ID == id {
			return m.Seq
		}
	}
	t.Fatalf("no message %s in the stream", id)
	return 0
}

// TestAuditRange: where the range's stream ends and what the table holds
// beyond what the stream proves. Rows keyed by their commit timestamp.
//   - A row re-published by jetbox repair, stored after later rows'
//     messages, is found when a past --until is audited again (the stream
//     is read past the range while rows are missing); the deleted message
//     is noted.
//   - Rows committed while jetbox run is stopped are not reported missing:
//     the range ends at the commit time of jetbox's last message
//     (requested_until says what was asked).
//   - A row whose created_at precedes its commit by more than the margin
//     (backfilled) and whose message is gone is not "complete": undecided.
//   - A stream with interest retention cannot be judged.
func TestAuditRange(t *testing.T) {
	testenv.SkipIfShort(t)
	f := newFixture(t, withPG(testenv.WithSetting("track_commit_timestamp", "on")))
	// A duplicate window of 1s: the deleted message's id has left it when
	// jetbox repair publishes the row again.
	f.env = append(f.env, "JETBOX_AUDIT_MARGIN=1s", "JETBOX_DUPLICATE_WINDOW=1s")
	conn := f.conn()
	ctx := ctxT(t, 5*time.Minute)
	p := f.start()
	f.waitStreaming(p)
	a := f.insertTx(conn, "a", 10)
	f.waitCount(10, time.Minute)
	var aCommit time.Time
	must(t, conn.QueryRow(ctx, `SELECT max(pg_xact_commit_timestamp(xmin)) FROM outbox`).Scan(&aCommit))
	// The next rows commit more than the margin later: their messages
	// are past the range that ends at a's commit.
	testenv.WaitFor(t, 10*time.Second, func() error {
		if d := time.Since(aCommit); d < 1500*time.Millisecond {
			return fmt.Errorf("%s since a's commit", d)
		}
		return nil
	})
	f.insertTx(conn, "b", 10)
	f.waitCount(20, time.Minute)
	if code := p.stop(); code != 0 {
		t.Fatalf("jetbox run exited with %d", code)
	}
	st, err := f.js.Stream(ctx, "OUTBOX")
	must(t, err)
	until := "JETBOX_AUDIT_UNTIL=" + aCommit.UTC().Format(time.RFC3339Nano)

	t.Run("repaired", func(t *testing.T) {
		must(t, st.DeleteMsg(ctx, seqOf(t, f, a[3])))
		rep := f.auditJSON(t, 1, until)
		if rep.Missing.Count != 1 || !slices.Equal(exampleIDs(rep.Missing), []string{a[3]}) || rep.Rows != 10 || rep.DeletedInStream != 1 {
			t.Fatalf("report %+v, want %s missing of 10 rows, 1 message deleted in the stream", rep, a[3])
		}
		f.pg.Exec(t, `SELECT pg_drop_replication_slot('jetbox')`) // repair creates it again
		f.repair("JETBOX_REPAIR_SINCE=" + rep.Missing.First[0].Time.Add(-time.Millisecond).UTC().Format(time.RFC3339Nano))
		if rep := f.auditJSON(t, 0, until); rep.Result != "complete" || rep.Rows != 10 || rep.Missing.Count != 0 || rep.Duplicated.Count+rep.OutOfOrder.Count != 0 {
			t.Fatalf("after the repair: report %+v, want 10 rows complete", rep)
		}
	})

	t.Run("unpublished", func(t *testing.T) {
		f.insertTx(conn, "c", 3) // jetbox run is stopped
		rep := f.auditJSON(t, 0)
		if rep.Result != "complete" || rep.Rows != 20 || rep.Missing.Count != 0 || rep.RequestedUntil == nil || rep.Until.After(*rep.RequestedUntil) {
			t.Fatalf("report %+v, want 20 rows complete, the range ending before the requested until", rep)
		}
		r := f.audit()
		if r.code != 0 || !strings.Contains(r.stdout, "where jetbox has provably published") {
			t.Fatalf("jetbox audit exited with %d, want 0 and the note on the range's end:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
	})

	t.Run("backfilled", func(t *testing.T) {
		p := f.start()
		f.waitStreaming(p)
		old := f.insertAt(conn, "Backfilled", "2000-01-01T00:00:00Z")
		f.insertTx(conn, "d", 1) // the range ends at its commit
		f.waitCount(25, time.Minute)
		if code := p.stop(); code != 0 {
			t.Fatalf("jetbox run exited with %d", code)
		}
		must(t, st.DeleteMsg(ctx, seqOf(t, f, old[0])))
		r := f.audit()
		if r.code != 2 || !strings.Contains(r.stderr, "cannot judge the range") || !strings.Contains(r.stderr, "--margin") {
			t.Fatalf("jetbox audit exited with %d, want 2 (undecided) naming the margin:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
	})

	t.Run("interest retention", func(t *testing.T) {
		info, err := st.Info(ctx)
		must(t, err)
		cfg := info.Config
		cfg.Retention = jetstream.InterestPolicy
		_, err = f.js.UpdateStream(ctx, cfg)
		must(t, err)
		r := f.audit(until)
		if r.code != 2 || !strings.Contains(r.stderr, "Interest retention") && !strings.Contains(r.stderr, "interest retention") {
			t.Fatalf("jetbox audit exited with %d, want 2 naming the retention:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
	})
}

// TestAuditRowIDs: a row whose id jetbox escapes in its dead letter
// ("Nats-" in it) is dead-lettered, not missing; a row without an order
// key (a NULL created_at) makes the audit undecided rather than complete.
func TestAuditRowIDs(t *testing.T) {
	testenv.SkipIfShort(t)
	f := newFixture(t, withDDL(`CREATE TABLE public.outbox (id text PRIMARY KEY, aggregate_type text, aggregate_id text, event_type text,
		payload jsonb, headers jsonb, created_at timestamptz DEFAULT now())`))
	f.env = append(f.env, "JETBOX_AUDIT_MARGIN=0s", "JETBOX_ON_INVALID=dead-letter")
	conn := f.conn()
	p := f.start()
	f.waitStreaming(p)
	f.pg.Exec(t, `INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES
		('good-1', 'order', '1', 'E', '{}'), ('r-Nats-Expected-Last-Sequence', 'order', '1', 'E', '{}'), ('good-2', 'order', '1', 'E', '{}')`)
	f.waitCount(3, time.Minute)
	if code := p.stop(); code != 0 {
		t.Fatalf("jetbox run exited with %d", code)
	}
	t.Run("escaped id", func(t *testing.T) {
		rep := f.auditJSON(t, 0)
		if rep.Rows != 3 || rep.Missing.Count+rep.NotInTable.Count != 0 || !slices.Equal(exampleIDs(rep.DeadLettered), []string{"r-Nats-Expected-Last-Sequence"}) {
			t.Fatalf("report %+v, want 3 rows, the bad id dead-lettered, nothing missing or not in the table", rep)
		}
	})
	t.Run("null key", func(t *testing.T) {
		_, err := conn.Exec(ctxT(t, 10*time.Second), `UPDATE outbox SET created_at = NULL WHERE id = 'good-2'`)
		must(t, err)
		r := f.audit()
		if r.code != 2 || !strings.Contains(r.stderr, "1 rows of the table have no order key") {
			t.Fatalf("jetbox audit exited with %d, want 2 naming the row without a key:\n%s\n%s", r.code, r.stdout, r.stderr)
		}
	})
}

// TestAuditJudgeable: a stream whose retention removes consumed messages
// cannot be judged even when it still holds seq 1; one that removed
// messages of the range while the audit ran cannot either.
func TestAuditJudgeable(t *testing.T) {
	since := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	wq := streamRange{first: 1, last: 10, msgs: 5, cfg: jetstream.StreamConfig{Retention: jetstream.WorkQueuePolicy}}
	var u *undecided
	if err := judgeable(wq, since, time.Minute); !errors.As(err, &u) || !strings.Contains(u.reason, "retention") {
		t.Errorf("work-queue stream: %v, want undecided naming the retention", err)
	}
	sr := streamRange{first: 1, last: 10, msgs: 10}
	if err := removed(sr, jetstream.StreamState{FirstSeq: 1, Msgs: 10}, since, time.Minute); err != nil {
		t.Errorf("nothing removed: %v", err)
	}
	if err := removed(sr, jetstream.StreamState{FirstSeq: 4, Msgs: 7, FirstTime: since.Add(-time.Hour)}, since, time.Minute); err != nil {
		t.Errorf("removed before the range only: %v", err)
	}
	if err := removed(sr, jetstream.StreamState{FirstSeq: 4, Msgs: 7, FirstTime: since.Add(time.Second)}, since, time.Minute); !errors.As(err, &u) {
		t.Errorf("removed into the range: %v, want undecided", err)
	}
}

// TestAuditMsgTimeline: positions are compared within one history: a
// message of a new timeline (a failover, a restore) with a lower LSN is
// another writer key, and a repair's message is marked. The origin parsed
// last is kept, and a message of another origin is parsed again.
func TestAuditMsgTimeline(t *testing.T) {
	h := func(src, lsn string) nats.Header {
		return nats.Header{"Jetbox-Source": {src}, "Jetbox-Commit-LSN": {lsn}, "Jetbox-Tx-Index": {"0"}, "Nats-Msg-Id": {"x"}}
	}
	var origins originCache
	m1, o1, ok1 := auditMsg(h("7/1/app/jetbox", "0/2000"), 1, time.Now(), &origins)
	m2, o2, _ := auditMsg(h("7/2/app/jetbox", "0/1000"), 2, time.Now(), &origins)
	if !ok1 || o1.Database != "app" || o1.Slot != "jetbox" || m1.Writer == m2.Writer || o2.Timeline != 2 {
		t.Errorf("writers %q and %q (origins %+v, %+v, %v): want one per timeline", m1.Writer, m2.Writer, o1, o2, ok1)
	}
	if m, o, ok := auditMsg(h("7/1/app/jetbox", "0/3000"), 3, time.Now(), &origins); !ok || o != o1 || m.Writer != m1.Writer {
		t.Errorf("back on timeline 1: writer %q, origin %+v (%v), want %q, %+v", m.Writer, o, ok, m1.Writer, o1)
	}
	if _, o, ok := auditMsg(h("not an origin", "0/3000"), 4, time.Now(), &origins); ok || o != (format.Origin{}) {
		t.Errorf("a foreign Jetbox-Source parsed as %+v (%v)", o, ok)
	}
	r := h("7/2/app/jetbox", "0/1000")
	r.Set("Jetbox-Repaired", "true")
	if m, _, _ := auditMsg(r, 5, time.Now(), &origins); !m.Repaired {
		t.Error("a repair's message is not marked repaired")
	}
}

// TestCheckOrderIndex: jetbox check warns when no index leads with the
// created-at column (the audit and the repair page through the table on
// it), with the CREATE INDEX that fixes it; with the index, it does not.
func TestCheckOrderIndex(t *testing.T) {
	f := newFixture(t)
	args := []string{"check", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL}
	var out, errOut bytes.Buffer
	if code := realMain(args, &out, &errOut); code != exitOK || !strings.Contains(out.String(), `CREATE INDEX CONCURRENTLY ON "public"."outbox" ("created_at", "id")`) {
		t.Fatalf("check without the index: exit %d, want 0 and the index warning:\n%s%s", code, out.String(), errOut.String())
	}
	f.pg.Exec(t, "CREATE INDEX ON outbox (created_at, id)")
	out.Reset()
	if code := realMain(args, &out, &errOut); code != exitOK || strings.Contains(out.String(), "postgres.order_index") {
		t.Fatalf("check with the index: exit %d:\n%s%s", code, out.String(), errOut.String())
	}
}

// fakeMessages is a MessagesContext over msgs: then err, or (err nil) it
// blocks until the context ends, as a consumer with nothing more to
// deliver does.
type fakeMessages struct {
	jetstream.MessagesContext
	msgs []jetstream.Msg
	err  error
	stop chan struct{} // closed by Stop
}

func (f *fakeMessages) Stop() { close(f.stop) }

func (f *fakeMessages) Next(opts ...jetstream.NextOpt) (jetstream.Msg, error) {
	if len(f.msgs) > 0 {
		m := f.msgs[0]
		f.msgs = f.msgs[1:]
		return m, nil
	}
	if f.err != nil {
		return nil, f.err
	}
	<-f.stop
	return nil, jetstream.ErrMsgIteratorClosed
}

type fakeMsg struct {
	jetstream.Msg
	seq, pending uint64
	h            nats.Header
}

func (m fakeMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{Sequence: jetstream.SequencePair{Stream: m.seq}, NumPending: m.pending, Timestamp: time.Now()}, nil
}
func (m fakeMsg) Headers() nats.Header { return m.h }

// TestAuditReadBatches: the stream's reader hands on every message in
// order, then the error it ended on; it hands on the message that may end
// the audit at once, without waiting for a full batch that may never come;
// and it stops at the last message.
func TestAuditReadBatches(t *testing.T) {
	msgs := func(n int, pending func(i int) uint64) []jetstream.Msg {
		var out []jetstream.Msg
		for i := 1; i <= n; i++ {
			out = append(out, fakeMsg{seq: uint64(i), pending: pending(i), h: nats.Header{"Nats-Msg-Id": {fmt.Sprint(i)}}})
		}
		return out
	}
	read := func(it *fakeMessages, lastSeq uint64, decides func(streamMsg) bool) []streamBatch {
		it.stop = make(chan struct{})
		ctx, cancel := context.WithCancel(context.Background())
		out := make(chan streamBatch)
		done := make(chan struct{})
		go func() { defer close(done); readBatches(ctx, it, lastSeq, decides, out) }()
		var got []streamBatch
		for {
			select {
			case b := <-out:
				got = append(got, b)
				if b.err != nil || (len(b.msgs) > 0 && (b.msgs[len(b.msgs)-1].last || decides(b.msgs[len(b.msgs)-1]))) {
					cancel()
					it.Stop()
					<-done
					return got
				}
			case <-time.After(10 * time.Second):
				cancel()
				t.Fatalf("no batch within 10s after %d batches", len(got))
			}
		}
	}
	never := func(streamMsg) bool { return false }
	ids := func(bs []streamBatch) (ids []string) {
		for _, b := range bs {
			for _, m := range b.msgs {
				ids = append(ids, m.msg.ID)
			}
		}
		return ids
	}
	// An error after 600 messages: a full batch, then 88 with the error.
	boom := errors.New("boom")
	bs := read(&fakeMessages{msgs: msgs(600, func(int) uint64 { return 1 }), err: boom}, 1000, never)
	if got := ids(bs); len(got) != 600 || got[0] != "1" || got[599] != "600" || !errors.Is(bs[len(bs)-1].err, boom) {
		t.Errorf("an error after 600 messages: %d messages, last batch error %v", len(got), bs[len(bs)-1].err)
	}
	// The 10th message decides, and the consumer then delivers nothing more.
	bs = read(&fakeMessages{msgs: msgs(10, func(int) uint64 { return 1 })}, 1000, func(m streamMsg) bool { return m.msg.ID == "10" })
	if got := ids(bs); len(got) != 10 {
		t.Errorf("the deciding message: %d messages handed on, want 10", len(got))
	}
	// The last message (no more pending) ends the read.
	bs = read(&fakeMessages{msgs: msgs(700, func(i int) uint64 { return uint64(700 - i) })}, 1000, never)
	if got := ids(bs); len(got) != 700 || !bs[len(bs)-1].msgs[len(bs[len(bs)-1].msgs)-1].last {
		t.Errorf("the last message: %d messages handed on", len(got))
	}
}

// TestAuditMemoryRestored: jetbox audit's GC setting (off but for the soft
// limit) is undone when the audit returns, so an audit run in a process
// that goes on (the tests) leaves its GC as it was.
func TestAuditMemoryRestored(t *testing.T) {
	if os.Getenv("GOGC") != "" || os.Getenv("GOMEMLIMIT") != "" {
		t.Skip("GOGC or GOMEMLIMIT set: the audit leaves the GC alone")
	}
	before, limit := debug.SetGCPercent(100), debug.SetMemoryLimit(-1)
	defer debug.SetGCPercent(before)
	restore := auditMemory()
	if got := debug.SetGCPercent(-1); got != -1 {
		t.Errorf("during the audit GOGC is %d, want off (-1)", got)
	}
	if got := debug.SetMemoryLimit(-1); got != auditMemoryLimit {
		t.Errorf("during the audit the memory limit is %d, want %d", got, auditMemoryLimit)
	}
	restore()
	if got := debug.SetGCPercent(before); got != 100 {
		t.Errorf("after the audit GOGC is %d, want 100", got)
	}
	if got := debug.SetMemoryLimit(-1); got != limit {
		t.Errorf("after the audit the memory limit is %d, want %d", got, limit)
	}
}
