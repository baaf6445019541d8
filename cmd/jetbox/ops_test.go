package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
)

// scrape reads /metrics into name{labels} → value.
func scrape(t testing.TB, addr string) map[string]float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") || line == "" {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

func getReady(t testing.TB, addr string) (int, readiness) {
	t.Helper()
	return getReadyPath(t, addr, "/readyz")
}

// getReadyPath is getReady on another readiness path (/readyz?standby=1).
func getReadyPath(t testing.TB, addr, path string) (int, readiness) {
	t.Helper()
	resp, err := http.Get("http://" + addr + path)
	if err != nil {
		return 0, readiness{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var r readiness
	_ = json.Unmarshal(b, &r)
	return resp.StatusCode, r
}

func httpAddr(t testing.TB) string { return fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)) }

// TestMetricsAndReadiness: /healthz, /readyz and the metrics follow what
// happens: events published, latency observed, confirmed LSN, and readiness
// lost while NATS is down.
func TestMetricsAndReadiness(t *testing.T) {
	f := newFixture(t)
	addr := httpAddr(t)
	p := f.start("JETBOX_HTTP_ADDR="+addr, "JETBOX_STATUS_INTERVAL=200ms")
	f.waitStreaming(p)
	testenv.WaitFor(t, 30*time.Second, func() error {
		if code, r := getReady(t, addr); code != 200 || !r.Ready || r.State != "streaming" {
			return fmt.Errorf("/readyz %d %+v", code, r)
		}
		return nil
	})
	resp, err := http.Get("http://" + addr + "/healthz")
	must(t, err)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/healthz %d", resp.StatusCode)
	}
	conn := f.conn()
	f.insertTx(conn, "a", 20)
	f.waitCount(20, 30*time.Second)
	testenv.WaitFor(t, 30*time.Second, func() error {
		m := scrape(t, addr)
		if m["jetbox_events_published_total"] != 20 || m["jetbox_end_to_end_latency_seconds_count"] != 20 ||
			m["jetbox_transactions_total"] < 1 || m["jetbox_confirmed_lsn"] <= 0 || m[`jetbox_state{state="streaming"}`] != 1 ||
			m["jetbox_server_wal_lsn"] <= 0 {
			return fmt.Errorf("metrics not there yet: published %v latency count %v tx %v confirmed %v streaming %v server %v",
				m["jetbox_events_published_total"], m["jetbox_end_to_end_latency_seconds_count"], m["jetbox_transactions_total"],
				m["jetbox_confirmed_lsn"], m[`jetbox_state{state="streaming"}`], m["jetbox_server_wal_lsn"])
		}
		return nil
	})

	f.nats.Stop()
	f.insertTx(conn, "b", 5)
	testenv.WaitFor(t, 30*time.Second, func() error {
		code, r := getReady(t, addr)
		if code != 503 || r.Ready || r.State != "republishing" {
			return fmt.Errorf("/readyz %d %+v while NATS is down", code, r)
		}
		if m := scrape(t, addr); m["jetbox_publish_errors_total"] < 1 || m[`jetbox_reconnects_total{side="nats"}`] != 0 {
			return fmt.Errorf("errors %v", m["jetbox_publish_errors_total"])
		}
		return nil
	})
	f.nats.Start()
	f.waitCount(25, time.Minute)
	testenv.WaitFor(t, 30*time.Second, func() error {
		code, r := getReady(t, addr)
		m := scrape(t, addr)
		if code != 200 || m[`jetbox_reconnects_total{side="nats"}`] < 1 || m["jetbox_publish_retries_total"] < 1 {
			return fmt.Errorf("/readyz %d %+v, nats reconnects %v, retries %v", code, r, m[`jetbox_reconnects_total{side="nats"}`], m["jetbox_publish_retries_total"])
		}
		return nil
	})
	p.stop()
}

// TestHeartbeat: with --heartbeat-interval, jetbox writes non-transactional
// logical messages to the WAL (seen by the oracle slot) and publishes nothing.
func TestHeartbeat(t *testing.T) {
	f := newFixture(t)
	f.newOracle()
	addr := httpAddr(t)
	p := f.start("JETBOX_HTTP_ADDR="+addr, "JETBOX_HEARTBEAT_INTERVAL=1s")
	f.waitStreaming(p)
	testenv.WaitFor(t, 30*time.Second, func() error {
		if n := scrape(t, addr)["jetbox_heartbeats_total"]; n < 2 {
			return fmt.Errorf("%v heartbeats", n)
		}
		return nil
	})
	// Decoded once the WAL writer flushed them.
	conn := f.conn()
	testenv.WaitFor(t, 30*time.Second, func() error {
		var n int
		must(t, conn.QueryRow(ctxT(t, 30*time.Second),
			"SELECT count(*) FROM pg_logical_slot_peek_changes('oracle', NULL, NULL) WHERE data LIKE '%prefix: jetbox-heartbeat%' AND data LIKE '%transactional: 0%'").Scan(&n))
		if n < 2 {
			return fmt.Errorf("%d heartbeat messages in the WAL", n)
		}
		return nil
	})
	if c, _ := testenv.StreamCount(f.js, "OUTBOX"); c != 0 {
		t.Fatalf("heartbeats published: %d messages", c)
	}
	// The slot follows the heartbeats though nothing else is written.
	var before string
	must(t, conn.QueryRow(ctxT(t, 5*time.Second), "SELECT pg_current_wal_lsn()::text").Scan(&before))
	testenv.WaitFor(t, 30*time.Second, func() error {
		var ok bool
		err := conn.QueryRow(ctxT(t, 5*time.Second), "SELECT confirmed_flush_lsn > $1::text::pg_lsn FROM pg_replication_slots WHERE slot_name = 'jetbox'", before).Scan(&ok)
		if err != nil || !ok {
			return fmt.Errorf("confirmed_flush_lsn not past %s (%v)", before, err)
		}
		return nil
	})
	p.stop()
}

// TestRetainedWALWarning: while NATS is unreachable the slot retains WAL;
// above --max-retained-wal jetbox warns in the log, the metric and /readyz.
func TestRetainedWALWarning(t *testing.T) {
	f := newFixture(t)
	addr := httpAddr(t)
	p := f.start("JETBOX_HTTP_ADDR="+addr, "JETBOX_MAX_RETAINED_WAL=1MiB", "JETBOX_MONITOR_INTERVAL=200ms")
	f.waitStreaming(p)
	conn := f.conn()
	f.nats.Stop()
	f.insertTx(conn, "stuck", 1) // the slot cannot pass it
	_, err := conn.Exec(ctxT(t, time.Minute), "INSERT INTO other (note) SELECT repeat('x', 1000) FROM generate_series(1, 8000)")
	must(t, err)
	_, err = conn.Exec(ctxT(t, time.Minute), "CHECKPOINT")
	must(t, err)
	testenv.WaitFor(t, time.Minute, func() error {
		_, r := getReady(t, addr)
		m := scrape(t, addr)
		if m["jetbox_slot_retained_wal_over_threshold"] != 1 || m["jetbox_slot_retained_wal_bytes"] < 1<<20 ||
			len(r.Warnings) == 0 || !strings.Contains(p.logText(), "retains more WAL than --max-retained-wal") {
			return fmt.Errorf("no warning yet: metric %v bytes %v readyz %+v", m["jetbox_slot_retained_wal_over_threshold"], m["jetbox_slot_retained_wal_bytes"], r)
		}
		return nil
	})
	f.nats.Start()
	f.waitCount(1, time.Minute)
	p.stop()
}

// TestHAStandby runs two instances on one slot: exactly one streams, the
// other stands by (metrics and /readyz say so) and takes over when the active
// one is SIGKILLed — repeatedly, under load. The stream still ends with every
// row once, in commit order. Takeover times are logged.
func TestHAStandby(t *testing.T) {
	f := newFixture(t)
	o := f.newOracle()
	addrs := []string{httpAddr(t), httpAddr(t)}
	procs := make([]*proc, 2)
	for i := range procs {
		procs[i] = f.start("JETBOX_HTTP_ADDR="+addrs[i], "JETBOX_STANDBY_RETRY=500ms")
	}
	active := func() (int, error) {
		var states []string
		streaming := -1
		for i, a := range addrs {
			_, r := getReady(t, a)
			states = append(states, r.State)
			if r.State == "streaming" {
				if streaming >= 0 {
					t.Fatalf("two instances streaming at once: %v", states)
				}
				streaming = i
			}
		}
		other := 1 - streaming
		if streaming < 0 || states[other] != "standby" {
			return -1, fmt.Errorf("states %v", states)
		}
		return streaming, nil
	}
	var cur int
	testenv.WaitFor(t, time.Minute, func() (err error) { cur, err = active(); return err })
	if code, r := getReady(t, addrs[1-cur]); code != 503 || r.Ready {
		t.Fatalf("standby /readyz = %d %+v, want 503", code, r)
	}
	if m := scrape(t, addrs[1-cur]); m[`jetbox_state{state="standby"}`] != 1 {
		t.Fatalf("standby metric: %v", m[`jetbox_state{state="standby"}`])
	}

	l := f.startLoad(2, 5*time.Millisecond, 1_000_000)
	defer l.stop()
	kills := envInt("JETBOX_HA_KILLS", 6)
	var takeovers []time.Duration
	var count uint64
	for i := 0; i < kills; i++ {
		count = f.progress(count, time.Minute)
		next := 1 - cur
		testenv.WaitFor(t, time.Minute, func() error { // the other one is a settled standby
			if _, r := getReady(t, addrs[next]); r.State != "standby" {
				return fmt.Errorf("state %q", r.State)
			}
			return nil
		})
		killed := time.Now()
		procs[cur].kill()
		testenv.WaitFor(t, time.Minute, func() error {
			if _, r := getReady(t, addrs[next]); r.State != "streaming" {
				return fmt.Errorf("standby state %q", r.State)
			}
			return nil
		})
		takeovers = append(takeovers, time.Since(killed))
		procs[cur] = f.start("JETBOX_HTTP_ADDR="+addrs[cur], "JETBOX_STANDBY_RETRY=500ms") // back as the standby
		cur = next
	}
	f.finish(l, o)
	t.Logf("takeover after SIGKILL of the active instance (standby retry 500ms): %v", takeovers)
}

// TestReadyzStandby: /readyz?standby=1 (the Helm chart's readiness with
// standbys) is 200 on the active instance and on a standby whose NATS
// connection is up, 503 on the standby while NATS is down; plain /readyz
// stays 503 on the standby.
func TestReadyzStandby(t *testing.T) {
	f := newFixture(t)
	addrs := []string{httpAddr(t), httpAddr(t)}
	for _, a := range addrs {
		f.start("JETBOX_HTTP_ADDR="+a, "JETBOX_STANDBY_RETRY=500ms")
	}
	standby := ""
	testenv.WaitFor(t, time.Minute, func() error {
		var states []string
		for _, a := range addrs {
			_, r := getReady(t, a)
			states = append(states, r.State)
		}
		switch {
		case states[0] == "streaming" && states[1] == "standby":
			standby = addrs[1]
		case states[1] == "streaming" && states[0] == "standby":
			standby = addrs[0]
		default:
			return fmt.Errorf("states %v, want one streaming and one standby", states)
		}
		return nil
	})
	for _, a := range addrs {
		if code, r := getReadyPath(t, a, "/readyz?standby=1"); code != 200 || !r.Ready {
			t.Fatalf("%s /readyz?standby=1 = %d %+v, want 200 (streaming or a connected standby)", a, code, r)
		}
	}
	if code, r := getReady(t, standby); code != 503 || r.Ready || r.State != "standby" {
		t.Fatalf("standby /readyz = %d %+v, want 503", code, r)
	}
	f.nats.Stop()
	testenv.WaitFor(t, 30*time.Second, func() error {
		if code, r := getReadyPath(t, standby, "/readyz?standby=1"); code != 503 || r.Ready || r.State != "standby" {
			return fmt.Errorf("standby /readyz?standby=1 = %d %+v while NATS is down, want 503", code, r)
		}
		return nil
	})
	f.nats.Start()
	testenv.WaitFor(t, time.Minute, func() error {
		if code, r := getReadyPath(t, standby, "/readyz?standby=1"); code != 200 || !r.Ready || r.State != "standby" {
			return fmt.Errorf("standby /readyz?standby=1 = %d %+v with NATS back, want 200", code, r)
		}
		return nil
	})
}

// TestHATakeoverAfterNetworkCut: the active instance's network to Postgres
// goes dark (blackholed, then the instance dies): the old walsender keeps the
// slot until wal_sender_timeout, then the standby takes over.
func TestHATakeoverAfterNetworkCut(t *testing.T) {
	f := newFixture(t, withPG(testenv.WithSetting("wal_sender_timeout", "5s")))
	o := f.newOracle()
	proxy := testenv.StartProxy(t, fmt.Sprintf("127.0.0.1:%d", f.pg.Port()))
	direct := f.pgURL
	f.pgURL = fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", proxy.Addr)
	a := f.start()
	f.waitStreaming(a)
	f.pgURL = direct
	addrB := httpAddr(t)
	b := f.start("JETBOX_HTTP_ADDR="+addrB, "JETBOX_STANDBY_RETRY=500ms")
	testenv.WaitFor(t, time.Minute, func() error {
		if _, r := getReady(t, addrB); r.State != "standby" {
			return fmt.Errorf("B state %q", r.State)
		}
		return nil
	})
	want := f.insertTx(f.conn(), "before", 10)
	f.waitCount(len(want), 30*time.Second)

	proxy.Pause()
	a.kill()
	cut := time.Now()
	testenv.WaitFor(t, time.Minute, func() error {
		if _, r := getReady(t, addrB); r.State != "streaming" {
			return fmt.Errorf("B state %q", r.State)
		}
		return nil
	})
	took := time.Since(cut)
	want = append(want, f.insertTx(f.conn(), "after", 10)...)
	f.waitCount(len(want), 30*time.Second)
	f.assertStream(o.ids())
	t.Logf("takeover after a network cut: %s (wal_sender_timeout 5s, standby retry 500ms)", took.Round(10*time.Millisecond))
	if took < 4*time.Second {
		t.Fatalf("took over in %s, before wal_sender_timeout released the slot: two walsenders on one slot?", took)
	}
	proxy.Resume()
	b.stop()
}
