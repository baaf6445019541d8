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

// TestCompareFlags: --baseline-bin, --status-intervals and --compare-bare
// run only the compare workload; the set-ups and what each is compared with.
func TestCompareFlags(t *testing.T) {
	c, err := parseFlags([]string{"--baseline-bin", "/old/a,/old/b", "--compare-delivery", "dedup,exactly-once"}, io.Discard)
	if err != nil || !c.runs("compare") || c.runs("steady") {
		t.Fatalf("baseline: %+v, %v", c, err)
	}
	vs := c.compareVariants("/cur")
	var got []string
	for _, v := range vs {
		got = append(got, v.Bin+"/"+v.Delivery)
	}
	want := []string{"/old/a/dedup", "/old/b/dedup", "/cur/dedup", "/old/a/exactly-once", "/old/b/exactly-once", "/cur/exactly-once"}
	if !slices.Equal(got, want) || vs[0].Ref != -1 || vs[2].Ref != 0 || vs[3].Ref != -1 || vs[5].Ref != 3 {
		t.Fatalf("variants %v (refs %+v), want %v", got, vs, want)
	}
	c, err = parseFlags([]string{"--status-intervals", "100ms,1s,10s", "--compare-delivery", "exactly-once"}, io.Discard)
	if err != nil || !c.runs("compare") || !slices.Equal(c.StatusIntervals, []time.Duration{100 * time.Millisecond, time.Second, 10 * time.Second}) {
		t.Fatalf("status intervals: %+v, %v", c, err)
	}
	vs = c.compareVariants("/cur")
	if len(vs) != 3 || vs[0].Ref != -1 || vs[2].Ref != 0 || !slices.Equal(vs[2].Env, []string{"JETBOX_STATUS_INTERVAL=10s"}) {
		t.Fatalf("status variants %+v", vs)
	}
	c, err = parseFlags([]string{"--status-intervals", "1s", "--floor-confirm", "both"}, io.Discard)
	if vs = c.compareVariants("/cur"); err != nil || len(vs) != 2 || vs[0].FloorQuiet || !vs[1].FloorQuiet || vs[1].Ref != 0 {
		t.Fatalf("floor both: %+v, %v", vs, err)
	}
	c, err = parseFlags([]string{"--compare-bare"}, io.Discard)
	if vs = c.compareVariants("/cur"); err != nil || !c.runs("compare") || c.runs("steady") || len(vs) != 3 ||
		vs[0].Bin != "/cur" || vs[0].Bare || !vs[1].Bare || vs[1].BareGuard || !vs[2].BareGuard || vs[1].Ref != -1 || vs[2].Ref != -1 {
		t.Fatalf("bare: %+v, %v", vs, err)
	}
	for _, bad := range [][]string{
		{"--only", "compare"},
		{"--status-intervals", "fast"},
		{"--baseline-bin", "/x", "--compare-delivery", "atomic"},
		{"--baseline-bin", "/x", "--reps", "0"},
		{"--floor-confirm", "maybe"},
	} {
		if _, err := parseFlags(bad, io.Discard); err == nil {
			t.Errorf("%s: no error", strings.Join(bad, " "))
		}
	}
}

// TestMedianOf: the median over the repetitions without an error.
func TestMedianOf(t *testing.T) {
	rep := func(ms int, err error) latencyRun {
		return latencyRun{Stats: latencyStats{P50: time.Duration(ms) * time.Millisecond}, Err: err}
	}
	p50 := func(l latencyRun) time.Duration { return l.Stats.P50 }
	if got := medianOf([]latencyRun{rep(3, nil), rep(1, nil), rep(100, io.EOF), rep(2, nil)}, p50); got != 2*time.Millisecond {
		t.Fatalf("odd: %v", got)
	}
	if got := medianOf([]latencyRun{rep(4, nil), rep(2, nil)}, p50); got != 3*time.Millisecond {
		t.Fatalf("even: %v", got)
	}
	if got := medianOf(nil, p50); got != 0 {
		t.Fatalf("none: %v", got)
	}
}

// TestCompareSmoke runs the compare workload for two short repetitions of
// jetbox and of the bare forwarder, without and with the guards: each
// set-up's stream must hold every row once, in commit order (a guarded
// publish refused by the server fails its set-up), and the report must
// give the bare forwarder's rows.
func TestCompareSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Postgres, NATS, jetbox and the bare forwarder")
	}
	if _, err := pgcluster.FindBinDir(); err != nil {
		if testenv.RequireServers() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	cfg := defaultConfig()
	cfg.WorkDir = t.TempDir()
	cfg.Only, cfg.CompareBare, cfg.Reps = []string{"compare"}, true, 2
	cfg.Writers, cfg.Steady, cfg.Timeout = 4, 2*time.Second, time.Minute
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg, zerolog.New(zerolog.NewTestWriter(t)).With().Timestamp().Logger())
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	rep.Print(&out)
	t.Logf("report:\n%s", out.String())
	if rep.Failed() {
		t.Fatal("a set-up failed or its stream was wrong (see the report)")
	}
	if len(rep.Compare) != 3 || !rep.Compare[1].Bare || !rep.Compare[2].BareGuard {
		t.Fatalf("%d set-ups, want jetbox's and the bare forwarder's two", len(rep.Compare))
	}
	for _, c := range rep.Compare {
		for _, l := range c.Reps {
			if l.Stats.N == 0 || l.Beyond.N == 0 {
				t.Errorf("%s: %d rows measured, %d beside the floor", c.Name, l.Stats.N, l.Beyond.N)
			}
		}
	}
	for _, v := range bareVariants {
		if !strings.Contains(out.String(), "| "+v.Name+" |") {
			t.Errorf("the report lacks the row of %q", v.Name)
		}
	}
}
