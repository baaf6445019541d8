package main

import (
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/pgcluster"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/rs/zerolog"
)

// TestWorkloadConfig: --workload alone runs only the workload, in the shape
// of the published benchmark it follows; bad settings are all reported.
func TestWorkloadConfig(t *testing.T) {
	c := parseFlagsOK(t, []string{"--workload"})
	if !c.runs(workloadName) || c.runs("dedup") || c.runs("steady") || c.runs("compare") {
		t.Fatalf("--workload: runs workload %v, dedup %v, steady %v", c.runs(workloadName), c.runs("dedup"), c.runs("steady"))
	}
	if !slices.Equal(c.WorkloadSizes, []int{100, 200, 400, 1600}) || c.WorkloadTx != 100 || !slices.IsSorted(c.WorkloadRates) {
		t.Errorf("shape: sizes %v, transactions of %d, rates %v", c.WorkloadSizes, c.WorkloadTx, c.WorkloadRates)
	}
	if parseFlagsOK(t, nil).runs(workloadName) {
		t.Error("the workload runs without --workload")
	}
	c = parseFlagsOK(t, []string{"--workload", "--only", "dedup", "--workload-sizes", "200", "--workload-rates", "1000,3000", "--workload-step", "2s"})
	if !c.runs(workloadName) || !c.runs("dedup") || !slices.Equal(c.WorkloadSizes, []int{200}) || c.WorkloadStep != 2*time.Second {
		t.Errorf("--workload with --only dedup: %+v", c)
	}
	_, err := parseFlags([]string{"--workload", "--workload-sizes", "10", "--workload-rates", "8000,4000,50", "--workload-step", "10ms", "--workload-delivery", "once"}, io.Discard)
	for _, want := range []string{`--workload-delivery: "once"`, "--workload-sizes: 10", "4000 does not follow 8000", "50 rows/s is less than one transaction", "--workload-step"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("want %q reported, got %v", want, err)
		}
	}
}

// TestWorkloadShape: each row's payload is the row size, a send commits a
// transaction of --workload-tx rows, and the sustained rate is the last
// rate kept before the first that was not.
func TestWorkloadShape(t *testing.T) {
	for _, size := range defaultConfig().WorkloadSizes {
		if p := timedPayload(time.Now(), size); len(p) != size {
			t.Errorf("payload of a %d-byte row is %d bytes", size, len(p))
		}
	}
	b := &bench{cfg: defaultConfig()}
	if s := (loadShape{payload: 400, txRows: 100}); s.size(b) != 400 || s.rows() != 100 {
		t.Errorf("shape %+v: size %d, rows %d", s, s.size(b), s.rows())
	}
	if s := (loadShape{}); s.size(b) != b.cfg.PayloadSize || s.rows() != 1 {
		t.Errorf("the steady runs' shape: size %d, rows %d", s.size(b), s.rows())
	}
	ms := time.Millisecond
	step := func(rate int, achieved float64, p99 time.Duration) latencyRun {
		return latencyRun{Rate: rate, Achieved: achieved, Stats: latencyStats{P99: p99}, Stored: latencyStats{P99: p99}}
	}
	w := &workloadRun{Sustained: 10000, Steps: []latencyRun{step(5000, 5000, 5*ms), step(10000, 9900, 40*ms), step(20000, 14000, 2*time.Second)}}
	if b := w.best(); b == nil || b.Rate != 10000 {
		t.Fatalf("best step %+v, want the one at 10,000", b)
	}
	if w.Steps[2].sustains() {
		t.Error("a step that kept 70% of its rate counts as sustained")
	}
	var out strings.Builder
	w.Forwarder, w.Size, w.Load = "jetbox", 100, []float64{1, 2, -1}
	(&Report{cfg: defaultConfig(), Workload: []*workloadRun{w}}).printWorkload(&out)
	for _, want := range []string{"| jetbox | 100 B | 20,000 | 14,000 |", "| 100 B | jetbox | 9,900 | 0.99 |", "**no**"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, out.String())
		}
	}
}

// TestWorkloadSmoke runs the workload in a tiny configuration: jetbox and
// the relay at one row size, every row once (in commit order for jetbox).
func TestWorkloadSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Postgres, NATS and jetbox")
	}
	if _, err := pgcluster.FindBinDir(); err != nil {
		if testenv.RequireServers() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	cfg := parseFlagsOK(t, []string{"--workload", "--workload-sizes", "1600", "--workload-rates", "1000,2000", "--workload-step", "1s",
		"--writers", "4", "--timeout", "1m"})
	cfg.WorkDir = t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg, zerolog.New(zerolog.NewTestWriter(t)).With().Timestamp().Logger())
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	rep.Print(&out)
	t.Logf("report:\n%s", out.String())
	if rep.Failed() || len(rep.Workload) != 2 {
		t.Fatalf("failed %v, %d workload runs (want 2)", rep.Failed(), len(rep.Workload))
	}
	for _, w := range rep.Workload {
		if len(w.Steps) == 0 || w.Steps[0].Stored.N != 1000 {
			t.Errorf("%s: %+v (want the first step's 1,000 samples)", w.Forwarder, w.Steps)
		}
	}
	if strings.Contains(out.String(), "| catch-up / publish |") {
		t.Error("the workload alone printed the catch-up table")
	}
}
