package main

import (
	"bytes"
	"context"
	"fmt"
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
// server, the polling relay, the bare forwarder), as the bench binary does.
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
	if st.ppid != 17 || st.self != 168*clockTick || st.kernel != 45*clockTick || st.children != 13*clockTick || st.minorFaults != 900 {
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
	want := latencyStats{N: 100, P50: 51 * time.Millisecond, P90: 91 * time.Millisecond, P99: 100 * time.Millisecond, P999: 100 * time.Millisecond,
		Max: 100 * time.Millisecond, Mean: 50500 * time.Microsecond}
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
	cfg.Scale, cfg.ScaleRows, cfg.ScalePayloads, cfg.ScaleTx = true, []int{500}, []int{100, 4096}, []int{1, 3500}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
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
	if len(rep.Sweeps) != len(steadySetups) || rep.RelaySteady == nil || rep.RawSteady == nil || len(rep.Startups) != 1 || rep.ProfilePath == "" || rep.ProfilePathExactly == "" || rep.Traced == nil {
		t.Fatalf("a workload did not run: sweeps %d, relay %v, raw %v, start-ups %v, profiles %q %q, traced %v",
			len(rep.Sweeps), rep.RelaySteady != nil, rep.RawSteady != nil, rep.Startups, rep.ProfilePath, rep.ProfilePathExactly, rep.Traced != nil)
	}
	if len(rep.Scale) != 5 {
		t.Errorf("%d scaling points, want 5", len(rep.Scale))
	}
	for _, want := range []string{"| jetbox, --delivery=dedup |", "| comparison | measured |", "catch-up: jetbox vs pg_recvlogical",
		"| same rows: floor", "| jetbox, exactly-once --atomic-transactions | 2,000 |", "Catch-up by payload size", "| 4,096 B |"} {
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
	if c, err = parseFlags([]string{"--only", "scale-tx"}, io.Discard); err != nil || !c.runs("scale-tx") || c.runs("scale-rows") || c.runs("dedup") {
		t.Errorf("--only scale-tx: %v, scale-tx %v, scale-rows %v, dedup %v", err, c.runs("scale-tx"), c.runs("scale-rows"), c.runs("dedup"))
	}
	if c, err = parseFlags([]string{"--scale"}, io.Discard); err != nil || !c.runs("scale-rows") || !c.runs("dedup") {
		t.Errorf("--scale: %v, scale-rows %v, dedup %v", err, c.runs("scale-rows"), c.runs("dedup"))
	}
	if c.runs("scale-rows") && (parseFlagsOK(t, nil).runs("scale-rows")) {
		t.Error("the scaling workloads run without --scale")
	}
	if _, err := parseFlags([]string{"--scale-payloads", "10,x", "--rows", "0"}, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "--scale-payloads") || !strings.Contains(err.Error(), "--rows") {
		t.Errorf("bad --scale-payloads and --rows: want both reported, got %v", err)
	}
	if _, err := parseFlags([]string{"--only", "dedup,nope"}, io.Discard); err == nil || !strings.Contains(err.Error(), `unknown workload "nope"`) {
		t.Errorf("--only nope: %v", err)
	}
}

func parseFlagsOK(t *testing.T, args []string) Config {
	t.Helper()
	c, err := parseFlags(args, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestSetFloor joins a step's samples with the floor by row and splits the
// rows above p99.
func TestSetFloor(t *testing.T) {
	ms := time.Millisecond
	var samples []latencySample
	floor := map[string]time.Duration{}
	for i := range 200 {
		id := fmt.Sprint(i)
		samples = append(samples, latencySample{id: id, consumer: 3 * ms, stored: 2 * ms})
		floor[id] = ms
	}
	samples[199].consumer, samples[199].stored, floor["199"] = 30*ms, 29*ms, 29500*time.Microsecond // slow upstream
	samples[198].consumer, samples[198].stored = 20*ms, 19*ms                                       // slow in the forwarder
	var r latencyRun
	if err := r.setFloor(samples, floor, nil); err != nil {
		t.Fatal(err)
	}
	if r.Floor.N != 200 || r.Beyond.P50 != 2*ms || r.Beyond.Max != 19*ms {
		t.Errorf("floor %+v, beyond %+v", r.Floor, r.Beyond)
	}
	// p99 is the 199th of 200 sorted: 20 ms; only the 30 ms row is above it.
	if r.Tail.N != 1 || r.Tail.Upstream != 1 || r.Tail.ToFloor != 29500*time.Microsecond {
		t.Errorf("tail %+v", r.Tail)
	}
	// jetbox's span of the slow forwarder row starts 1 ms after the floor had it.
	base := time.Unix(1000, 0)
	for i := range samples {
		samples[i].sent = base
	}
	spans := map[string]spanTimes{"198": {start: base.Add(2 * ms)}, "199": {start: base.Add(29600 * time.Microsecond)}}
	if err := r.setFloor(samples, floor, spans); err != nil {
		t.Fatal(err)
	}
	if r.Behind.N != 2 || r.Behind.Max != ms || r.Own.Max != 17*ms || r.Tail.Traced != 1 || r.Tail.ToReceived != 100*time.Microsecond ||
		r.Tail.ToOwn != -600*time.Microsecond || r.Tail.ToStored != -500*time.Microsecond {
		t.Errorf("behind %+v, own %+v, tail %+v", r.Behind, r.Own, r.Tail)
	}
	delete(floor, "5")
	if err := r.setFloor(samples, floor, nil); err == nil {
		t.Error("a row the floor never received is not reported")
	}
}

// TestSweepKnee: the knee is the highest rate up to which every step was
// flat; the sweep stops at the first rate not sustained.
func TestSweepKnee(t *testing.T) {
	run := func(rate int, p99 time.Duration) latencyRun {
		return latencyRun{Rate: rate, Achieved: float64(rate), Stats: latencyStats{P99: p99}}
	}
	var sw sweep
	ms := time.Millisecond
	for _, r := range []latencyRun{run(2000, ms), run(4000, 20*ms), run(8000, 2*ms)} {
		if !sw.add(r, 10*ms) {
			t.Fatalf("rate %d not sustained", r.Rate)
		}
	}
	if sw.Knee != 2000 || sw.Sustained != 8000 {
		t.Errorf("knee %d, sustained %d; want 2000, 8000", sw.Knee, sw.Sustained)
	}
	if sw.add(run(16000, time.Second), 10*ms) {
		t.Error("a backlog of a second counts as sustained")
	}
}
