package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestTypedFlagProblemsTogether: a bad duration, a bad count and a bad size
// on one command line are all reported in one run (exit 2), each quoting
// the value as given: the typed flags never stop kong's parse at the first.
// The same holds for their JETBOX_* variables.
func TestTypedFlagProblemsTogether(t *testing.T) {
	want := []string{
		`--publish-timeout (JETBOX_PUBLISH_TIMEOUT) = "soon": not a duration; fix: use a Go duration such as 500ms, 30s or 2m`,
		`--max-in-flight (JETBOX_MAX_IN_FLIGHT) = "many": not a count between 1 and 100000; fix: use e.g. 1024`,
		`--max-retained-wal (JETBOX_MAX_RETAINED_WAL) = "lots": not a size; fix: use e.g. 1GiB, or 0 to disable`,
	}
	check := func(what string, args ...string) {
		t.Helper()
		var out, errOut bytes.Buffer
		code := realMain(append([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--log-format=console"}, args...), &out, &errOut)
		got := errOut.String()
		if code != exitConfig || !strings.Contains(got, "jetbox: 3 configuration problem(s):") {
			t.Fatalf("%s: exit %d, want %d and 3 problems:\n%s", what, code, exitConfig, got)
		}
		for _, w := range want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: stderr lacks %q:\n%s", what, w, got)
			}
		}
	}
	check("flags", "--publish-timeout=soon", "--max-in-flight=many", "--max-retained-wal=lots")
	t.Setenv("JETBOX_PUBLISH_TIMEOUT", "soon")
	t.Setenv("JETBOX_MAX_IN_FLIGHT", "many")
	t.Setenv("JETBOX_MAX_RETAINED_WAL", "lots")
	check("variables")
}

// TestTypedFlagValues: defaults, variables and flags reach the typed
// values through Decode; a value kong's scanner gives apart from the flag
// (--flag value) is read too; "" is no value of any type.
func TestTypedFlagValues(t *testing.T) {
	var f RunFlags
	parseDefaults(t, &f)
	if f.FinalScrape.Value != time.Minute || f.FinalScrape.Text != "1m" || f.FinalScrape.Err != nil {
		t.Errorf("--final-scrape-wait default: %+v, want 1m", f.FinalScrape)
	}
	if f.MaxInFlightBytes.Value != 8<<20 || f.MaxRetainedWAL.Value != 1<<30 || f.OrderGuard.Value != true || f.AtomicTx.Value {
		t.Errorf("defaults: max-in-flight-bytes %+v, max-retained-wal %+v, order-guard %+v, atomic-transactions %+v",
			f.MaxInFlightBytes, f.MaxRetainedWAL, f.OrderGuard, f.AtomicTx)
	}
	if f.DuplicateWindow.Text != "" || f.StreamMaxBytes.Text != "" {
		t.Errorf("flags without a default hold %+v, %+v; want no text (not given)", f.DuplicateWindow, f.StreamMaxBytes)
	}

	t.Setenv("JETBOX_STREAM_MAX_BYTES", "50GiB")
	var c cli
	exitCode := -1
	var stderr strings.Builder
	parser, err := newParser(&c, discard{}, &stderr, &exitCode)
	must(t, err)
	if kctx, code := parseCommand(parser, &exitCode, []string{"run", "--postgres-url=postgres://u@127.0.0.1/db", "--max-in-flight", "512", "--heartbeat-interval=10s", "--atomic-transactions"}, &stderr); kctx == nil {
		t.Fatalf("parse: exit %d: %s", code, stderr.String())
	}
	r := c.Run
	if r.MaxInFlight.Value != 512 || r.Heartbeat.Value != 10*time.Second || !r.AtomicTx.Value || r.AtomicTx.Text != "true" || r.StreamMaxBytes.Value != 50<<30 {
		t.Errorf("max-in-flight %+v, heartbeat-interval %+v, atomic-transactions %+v, stream-max-bytes %+v",
			r.MaxInFlight, r.Heartbeat, r.AtomicTx, r.StreamMaxBytes)
	}
	if cfg, err := r.Config(); err != nil || cfg.Replication.MaxInFlight != 512 || cfg.Sink.StreamSpec.MaxBytes != 50<<30 {
		t.Errorf("config: max in flight %d, stream max bytes %d, %v", cfg.Replication.MaxInFlight, cfg.Sink.StreamSpec.MaxBytes, err)
	}

	for _, v := range []interface {
		set(string)
		failed() bool
	}{&durationFlag{}, &intFlag{}, &sizeFlag{}, &boolFlag{}} {
		v.set("")
		if !v.failed() {
			t.Errorf("%T: \"\" parsed", v)
		}
	}
	if !(durationFlag{}).failed() {
		t.Error("a flag kong never decoded holds a value")
	}
}
