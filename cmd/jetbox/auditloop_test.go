package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

const (
	auditCompleteUntil = "jetbox_audit_complete_until_timestamp_seconds"
	auditMissing       = "jetbox_audit_missing_rows"
)

// TestContinuousAudit: jetbox run --audit-interval=2s --audit-grace=1s
// audits on the instance that streams, not on its standby. Rows streamed
// show 0 missing and jetbox_audit_complete_until_timestamp_seconds
// advancing past their commit; a row whose message is deleted from the
// stream by hand shows as missing in the metric, on /readyz and in a log
// line naming its id and the repair command, and complete_until stops
// before it. The audit proves complete only what jetbox has published: up
// to its last message's commit time (--audit-margin 0s: the test's
// transactions are instant), so the window advances as rows are streamed.
func TestContinuousAudit(t *testing.T) {
	testenv.SkipIfShort(t)
	f := newFixture(t)
	addrA, addrB := httpAddr(t), httpAddr(t)
	env := []string{"JETBOX_AUDIT_INTERVAL=2s", "JETBOX_AUDIT_GRACE=1s", "JETBOX_AUDIT_MARGIN=0s", "JETBOX_MONITOR_INTERVAL=200ms"}
	a := f.start(append(env, "JETBOX_HTTP_ADDR="+addrA)...)
	f.waitStreaming(a)
	b := f.start(append(env, "JETBOX_HTTP_ADDR="+addrB)...)
	testenv.WaitFor(t, 30*time.Second, func() error {
		if _, r := getReady(t, addrB); r.State != "standby" {
			return fmt.Errorf("b's /readyz: %+v", r)
		}
		return nil
	})

	conn := f.conn()
	for i := 0; i < 3; i++ {
		f.insertTx(conn, "a", 50)
	}
	f.waitCount(150, time.Minute)
	var committed time.Time
	must(t, conn.QueryRow(ctxT(t, 10*time.Second), `SELECT max(created_at) FROM outbox`).Scan(&committed))

	// Proven complete past the rows, nothing missing.
	var until float64
	testenv.WaitFor(t, time.Minute, func() error {
		m := scrape(t, addrA)
		until = m[auditCompleteUntil]
		if m[auditMissing] != 0 || m[`jetbox_audit_runs_total{result="complete"}`] < 1 || until < unixSeconds(committed) {
			return fmt.Errorf("missing %v, complete runs %v, complete until %v (rows up to %v)", m[auditMissing],
				m[`jetbox_audit_runs_total{result="complete"}`], until, unixSeconds(committed))
		}
		return nil
	})
	f.insertTx(conn, "b", 1)
	f.waitCount(151, time.Minute)
	testenv.WaitFor(t, time.Minute, func() error { // and advancing as rows are streamed
		if v := scrape(t, addrA)[auditCompleteUntil]; v <= until {
			return fmt.Errorf("complete until %v, not past %v yet", v, until)
		}
		return nil
	})
	mb := scrape(t, addrB)
	for _, r := range []string{"complete", "found", "undecided", "error"} {
		k := fmt.Sprintf("jetbox_audit_runs_total{result=%q}", r)
		if v, ok := mb[k]; !ok || v != 0 {
			t.Errorf("standby b: %s is %v (exported: %v), want 0", k, v, ok)
		}
	}
	if v := mb[auditCompleteUntil]; v != 0 {
		t.Errorf("standby b: %s is %v, want 0 (it does not audit)", auditCompleteUntil, v)
	}

	// A row whose key lies a few seconds ahead: its message is stored at
	// once and deleted before any audit's window reaches the row.
	var gapID string
	var gapKey time.Time
	must(t, conn.QueryRow(ctxT(t, 10*time.Second), `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
		VALUES ('order', 'gap', 'OrderCreated', '{}', now() + interval '4 seconds') RETURNING id::text, created_at`).Scan(&gapID, &gapKey))
	f.waitCount(152, 30*time.Second)
	stored := testenv.ReadStream(t, f.js, "OUTBOX", true)
	last := stored[len(stored)-1]
	if last.ID != gapID {
		t.Fatalf("the stream's last message is %s, want the gap row %s", last.ID, gapID)
	}
	st, err := f.js.Stream(ctxT(t, 10*time.Second), "OUTBOX")
	must(t, err)
	must(t, st.DeleteMsg(ctxT(t, 10*time.Second), last.Seq))
	if now := time.Now(); !now.Before(gapKey.Add(time.Second)) {
		t.Fatalf("the message was deleted at %s, after an audit could have covered its row (key %s, grace 1s)", now, gapKey)
	}

	tail := false
	testenv.WaitFor(t, time.Minute, func() error {
		if !tail && time.Now().After(gapKey) {
			// A row committed after the gap row's key: jetbox has
			// published past it, so the audit's window covers it.
			f.insertTx(conn, "c", 1)
			tail = true
		}
		if v := scrape(t, addrA)[auditMissing]; v != 1 {
			return fmt.Errorf("%s is %v, want 1", auditMissing, v)
		}
		return nil
	})
	m := scrape(t, addrA)
	if v := m[auditCompleteUntil]; v >= unixSeconds(gapKey) {
		t.Errorf("complete until %v, at or after the missing row's key %v", v, unixSeconds(gapKey))
	}
	if m[`jetbox_audit_runs_total{result="found"}`] < 1 {
		t.Errorf("no audit counted found: %v", m[`jetbox_audit_runs_total{result="found"}`])
	}
	code, r := getReady(t, addrA)
	if code != 200 || !strings.Contains(strings.Join(r.Warnings, "\n"), gapID) || !strings.Contains(strings.Join(r.Warnings, "\n"), "jetbox repair --since") {
		t.Errorf("/readyz %d %+v: want ready with a warning naming %s and the repair", code, r, gapID)
	}
	testenv.WaitFor(t, 10*time.Second, func() error {
		for _, line := range strings.Split(a.logText(), "\n") {
			if strings.Contains(line, `"first_missing":["`+gapID+`"]`) && strings.Contains(line, `"repair":"jetbox repair --since `) {
				return nil
			}
		}
		return fmt.Errorf("no log line names the missing row %s and the repair:\n%s", gapID, a.tail(2048))
	})
	a.stop()
	b.stop()
}

// TestAuditRunRate measures the stream's rate with and without the
// continuous audit on JETBOX_AUDIT_RUN_ROWS rows (skipped when unset;
// docs/performance.md has the figure): rows inserted in transactions of
// 10,000 while jetbox run streams, timed from the first insert to the last
// message stored; with the audit every second and no grace, so that audits
// overlap the stream throughout.
func TestAuditRunRate(t *testing.T) {
	testenv.SkipIfShort(t)
	n := envInt("JETBOX_AUDIT_RUN_ROWS", 0)
	if n == 0 {
		t.Skip("set JETBOX_AUDIT_RUN_ROWS")
	}
	for _, mode := range []struct {
		name string
		env  []string
	}{{"off", nil}, {"every 1s", []string{"JETBOX_AUDIT_INTERVAL=1s", "JETBOX_AUDIT_GRACE=0s"}}} {
		t.Run(mode.name, func(t *testing.T) {
			f := newFixture(t)
			addr := httpAddr(t)
			p := f.start(append(mode.env, "JETBOX_HTTP_ADDR="+addr)...)
			f.waitStreaming(p)
			began := time.Now()
			for done := 0; done < n; done += 10_000 {
				f.pg.Exec(t, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
					SELECT 'order', 'o-' || g, 'OrderCreated', jsonb_build_object('n', g) FROM generate_series(1, $1) g`, min(10_000, n-done))
			}
			f.waitCount(n, 10*time.Minute)
			el := time.Since(began)
			m := scrape(t, addr)
			runs := 0.0
			for _, r := range []string{"complete", "found", "undecided", "error"} {
				runs += m[fmt.Sprintf("jetbox_audit_runs_total{result=%q}", r)]
			}
			t.Logf("audit %s: %d rows streamed in %s, %.0f rows/s, %.0f audits", mode.name, n, el.Round(time.Millisecond), float64(n)/el.Seconds(), runs)
			p.stop()
		})
	}
}
