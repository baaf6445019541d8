package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/audit"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// auditResult is one jetbox audit run.
type auditResult struct {
	code           int
	stdout, stderr string
	elapsed        time.Duration
	maxRSS         int64 // bytes
}

// audit runs jetbox audit to its end; extra env entries override.
func (f *fixture) audit(extra ...string) auditResult {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, jetboxBin, "audit")
	cmd.Env = append(append(append(os.Environ(), "JETBOX_POSTGRES_URL="+f.pgURL, "JETBOX_NATS_URL="+f.natURL, "JETBOX_AUDIT_GRACE=0s"), f.env...), extra...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	began := time.Now()
	err := cmd.Run()
	elapsed := time.Since(began)
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		f.t.Fatalf("jetbox audit: %v", err)
	}
	var rss int64
	if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
		rss = ru.Maxrss * 1024 // kB on Linux
	}
	return auditResult{code, out.String(), errb.String(), elapsed, rss}
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
	t.Run("created_at", func(t *testing.T) { testAudit(t, newFixture(t), "created_at, then id") })
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
	p := f.start("JETBOX_LOG_LEVEL=info")
	f.waitStreaming(p)
	for done := 0; done < n; done += 10_000 {
		f.pg.Exec(t, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
			SELECT 'order', 'o-' || g, 'OrderCreated', jsonb_build_object('n', g) FROM generate_series(1, $1) g`, min(10_000, n-done))
	}
	f.waitCount(n, 10*time.Minute)
	if code := p.stop(); code != 0 {
		t.Fatalf("jetbox run exited with %d", code)
	}
	r := f.audit()
	if r.code != 0 || !strings.Contains(r.stdout, fmt.Sprintf("rows:           %d\n", n)) {
		t.Fatalf("jetbox audit exited with %d, want 0 with %d rows:\n%s\n%s", r.code, n, r.stdout, r.stderr)
	}
	t.Logf("audit of %d rows: %s, %.0f rows/s, peak RSS %.1f MiB", n, r.elapsed.Round(time.Millisecond), float64(n)/r.elapsed.Seconds(), float64(r.maxRSS)/(1<<20))
}
