package main

import (
	"io"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestCompareFlags: --baseline-bin and --status-intervals run only the
// compare workload; the set-ups and what each is compared with.
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
