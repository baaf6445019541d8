package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/pgcluster"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// TestMain lets the test binary serve the bench's child roles (the NATS
// server, the polling relay), as the bench binary does.
func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(runChild(role, os.Args[1:], os.Stderr))
	}
	os.Exit(m.Run())
}

func TestParseProcStat(t *testing.T) {
	// A command name with spaces and a parenthesis, as a process may choose.
	line := "4242 (postgres: wal sender) (x)) S 17 4242 4242 0 -1 4194560 900 0 0 0 123 45 6 7 20 0 1 0 100 0 0"
	st, err := parseProcStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if st.ppid != 17 || st.self != 168*clockTick || st.children != 13*clockTick {
		t.Fatalf("got %+v", st)
	}
	if _, err := parseProcStat([]byte("42 (short) S 1 2")); err == nil {
		t.Fatal("a short line parsed")
	}
}

func TestSendTimeRoundTrip(t *testing.T) {
	now := time.Unix(1764584536, 123456789)
	p := timedPayload(now, 300)
	if len(p) != 300 {
		t.Fatalf("payload is %d bytes, want 300", len(p))
	}
	// As sent, and as jsonb renders it back.
	for _, text := range [][]byte{p, bytes.Replace(p, []byte(`"ts": `), []byte(`"ts":`), 1)} {
		got, err := sendTime(text)
		if err != nil || !got.Equal(now) {
			t.Fatalf("sendTime(%.40q) = %v, %v; want %v", text, got, err, now)
		}
	}
	if _, err := sendTime([]byte(`{"n": 1}`)); err == nil {
		t.Fatal("a payload without a send time parsed")
	}
}

func TestSummarize(t *testing.T) {
	var s []time.Duration
	for i := 100; i >= 1; i-- {
		s = append(s, time.Duration(i)*time.Millisecond)
	}
	got := summarize(s)
	want := latencyStats{N: 100, P50: 51 * time.Millisecond, P90: 91 * time.Millisecond, P99: 100 * time.Millisecond, Max: 100 * time.Millisecond}
	if got != want {
		t.Fatalf("summarize = %+v, want %+v", got, want)
	}
}

// TestStreamCheck: the check every run's output goes through catches an
// unknown id, a duplicate, a missing row and a break of commit order.
func TestStreamCheck(t *testing.T) {
	msg := func(id, lsn, idx string) nats.Header {
		return nats.Header{"Nats-Msg-Id": {id}, "Jetbox-Commit-LSN": {lsn}, "Jetbox-Tx-Index": {idx}}
	}
	newCheck := func() *streamCheck {
		return &streamCheck{stream: "S", want: map[string]bool{"a": false, "b": false}, ordered: true}
	}
	c := newCheck()
	if err := c.add(msg("a", "0/10", "0"), 1); err != nil {
		t.Fatal(err)
	}
	if err := c.add(msg("b", "0/10", "1"), 2); err != nil {
		t.Fatal(err)
	}
	if err := c.complete(); err != nil {
		t.Fatal(err)
	}
	for name, bad := range map[string][]nats.Header{
		"unknown":   {msg("z", "0/10", "0")},
		"duplicate": {msg("a", "0/10", "0"), msg("a", "0/20", "0")},
		"reordered": {msg("a", "0/20", "0"), msg("b", "0/10", "0")},
	} {
		c := newCheck()
		var err error
		for i, h := range bad {
			if err = c.add(h, uint64(i+1)); err != nil {
				break
			}
		}
		if err == nil {
			t.Errorf("%s: not caught", name)
		}
	}
	c = newCheck()
	_ = c.add(msg("a", "0/10", "0"), 1)
	if err := c.complete(); err == nil {
		t.Error("a missing row is not caught")
	}
}

// TestBenchSmoke runs the whole benchmark in a tiny configuration, so the
// command keeps working: every workload runs and every check passes.
func TestBenchSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Postgres, NATS and jetbox")
	}
	if _, err := pgcluster.FindBinDir(); err != nil {
		if testenv.RequireServers() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	cfg := defaultConfig()
	cfg.WorkDir = t.TempDir()
	cfg.Rows, cfg.BigTx, cfg.Writers, cfg.Starts = 3000, 2000, 4, 1
	cfg.Steady, cfg.Step, cfg.Rates = 2*time.Second, time.Second, []int{3000}
	cfg.Profile, cfg.Trace, cfg.Timeout = true, true, time.Minute
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg, zerolog.New(zerolog.NewTestWriter(t)).With().Timestamp().Logger())
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	rep.Print(&out)
	t.Logf("report:\n%s", out.String())
	if rep.Failed() {
		t.Fatal("a workload failed or its output was wrong (see the report)")
	}
	for _, tp := range rep.throughputs() {
		if tp.Err == nil && tp.rate() <= 0 {
			t.Errorf("%s: no rate", tp.Name)
		}
	}
	if rep.Steady == nil || rep.RelaySteady == nil || rep.RawSteady == nil || len(rep.Startups) != 1 || rep.ProfilePath == "" || rep.ProfilePathExactly == "" || rep.Traced == nil {
		t.Fatalf("a workload did not run: steady %v, relay %v, raw %v, start-ups %v, profiles %q %q, traced %v",
			rep.Steady != nil, rep.RelaySteady != nil, rep.RawSteady != nil, rep.Startups, rep.ProfilePath, rep.ProfilePathExactly, rep.Traced != nil)
	}
	for _, want := range []string{"| jetbox, --delivery=dedup |", "| comparison | measured |", "catch-up: jetbox vs pg_recvlogical"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q", want)
		}
	}
}

func TestOnlyFlag(t *testing.T) {
	c, err := parseFlags([]string{"--only", "dedup, exactly-once"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for w, want := range map[string]bool{"dedup": true, "exactly-once": true, "recv": false, "steady": false, "big-tx": false, "profile": false} {
		if c.runs(w) != want {
			t.Errorf("--only dedup,exactly-once: runs(%s) = %v", w, !want)
		}
	}
	if c, err = parseFlags([]string{"--only", "profile"}, io.Discard); err != nil || !c.Profile || c.runs("dedup") {
		t.Errorf("--only profile: %v, profile %v, dedup %v", err, c.Profile, c.runs("dedup"))
	}
	if c, err = parseFlags(nil, io.Discard); err != nil || !c.runs("relay") || c.runs("profile") {
		t.Errorf("no --only: %v, relay %v, profile %v", err, c.runs("relay"), c.runs("profile"))
	}
	if _, err := parseFlags([]string{"--only", "dedup,nope"}, io.Discard); err == nil || !strings.Contains(err.Error(), `unknown workload "nope"`) {
		t.Errorf("--only nope: %v", err)
	}
}
