package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go/jetstream"
)

// TestStreamFlags: the --stream-* flags and --duplicate-window parse into
// the spec of the stream jetbox creates, record what was given (env too),
// derive the duplicate window from the delivery mode when not given, and
// report every bad value at once, each with its fix.
func TestStreamFlags(t *testing.T) {
	f := RunFlags{}
	parseDefaults(t, &f)
	f.PostgresURL = "postgres://u@127.0.0.1/db"
	f.StreamReplicas.set("3")
	f.StreamMaxAge.set("168h")
	f.StreamMaxBytes.set("50GiB")
	f.StreamMaxMsgs.set("-1")
	f.StreamStorage, f.StreamDiscard = "file", "new"
	cfg, err := f.Config()
	if err != nil {
		t.Fatal(err)
	}
	sp := cfg.Sink.StreamSpec
	if sp.Replicas != 3 || sp.MaxAge != 168*time.Hour || sp.MaxBytes != 50<<30 || sp.MaxMsgs != -1 || sp.Storage != jetstream.FileStorage || sp.Discard != jetstream.DiscardNew {
		t.Errorf("spec %+v", sp)
	}
	for _, k := range []string{"replicas", "max-age", "max-bytes", "max-msgs", "storage", "discard"} {
		if !sp.Given[k] {
			t.Errorf("%s not recorded as given", k)
		}
	}
	if sp.Given["duplicate-window"] || cfg.Sink.DuplicateWindow != time.Second {
		t.Errorf("exactly-once, no --duplicate-window: window %s (given %v), want 1s", cfg.Sink.DuplicateWindow, sp.Given["duplicate-window"])
	}
	f.Delivery, f.StreamMaxAge = "dedup", durationFlag{} // not given
	if cfg, err = f.Config(); err != nil || cfg.Sink.DuplicateWindow != 10*time.Minute {
		t.Errorf("dedup, no --duplicate-window: window %s, %v; want --max-outage, 10m", cfg.Sink.DuplicateWindow, err)
	}
	f.Delivery = "exactly-once"
	f.StreamReplicas.set("auto")
	f.DuplicateWindow.set("auto")
	if cfg, err = f.Config(); err != nil || cfg.Sink.StreamSpec.Replicas != 0 || cfg.Sink.StreamSpec.Given["replicas"] || cfg.Sink.StreamSpec.Given["duplicate-window"] {
		t.Errorf("auto: %+v, %v", cfg.Sink.StreamSpec, err)
	}

	var out, errOut bytes.Buffer
	code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--stream-replicas=7", "--stream-max-age=5m",
		"--stream-max-bytes=lots", "--stream-max-msgs=many", "--stream-storage=disk", "--stream-discard=oldest", "--duplicate-window=30m"}, &out, &errOut)
	if code != exitConfig {
		t.Fatalf("exit %d, want %d", code, exitConfig)
	}
	for _, want := range []string{"--stream-replicas (JETBOX_STREAM_REPLICAS) = \"7\"", "shorter than --max-outage 10m0s", "--stream-max-bytes", "--stream-max-msgs",
		"--stream-storage", "use file or memory", "--stream-discard", "use old or new", "longer than --stream-max-age 5m0s"} {
		if !strings.Contains(plainLog(errOut.String()), want) {
			t.Errorf("output lacks %q:\n%s", want, plainLog(errOut.String()))
		}
	}
	t.Setenv("JETBOX_STREAM_REPLICAS", "0")
	errOut.Reset()
	if code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db"}, &out, &errOut); code != exitConfig || !strings.Contains(plainLog(errOut.String()), "JETBOX_STREAM_REPLICAS") {
		t.Errorf("env not validated: exit %d:\n%s", code, plainLog(errOut.String()))
	}
}

// TestCheckStreamConfig: `jetbox check` says what stream it would create
// (on a single server: R1, with the limits given), and against an existing
// stream that differs from the flags, the difference and the nats stream
// edit line, exit 0 (a warning). `jetbox run` then logs the same and
// leaves the stream as it is.
func TestCheckStreamConfig(t *testing.T) {
	f := newFixture(t)
	args := []string{"check", "--postgres-url=" + f.pg.DSN, "--nats-url=" + f.nats.URL, "--stream-max-bytes=10GiB", "--stream-discard=new"}
	var out, errOut bytes.Buffer
	if code := realMain(args, &out, &errOut); code != exitOK {
		t.Fatalf("exit %d:\n%s%s", code, out.String(), plainLog(errOut.String()))
	}
	for _, want := range []string{`stream "OUTBOX" is missing: jetbox run creates it with subjects ["outbox.>"], file storage, 1 replica(s), limits retention, max age unlimited, max bytes 10737418240, max messages unlimited, discard new, duplicate window 1s (replicas from a single server`,
		"would have 1 replica(s)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("check output lacks %q:\n%s", want, out.String())
		}
	}
	_, err := f.js.CreateStream(ctxT(t, 10*time.Second), jetstream.StreamConfig{Name: "OUTBOX", Subjects: []string{"outbox.>"}, Duplicates: 2 * time.Minute})
	must(t, err)
	out.Reset()
	if code := realMain(args, &out, &errOut); code != exitOK {
		t.Fatalf("exit %d:\n%s%s", code, out.String(), plainLog(errOut.String()))
	}
	const edit = "nats stream edit OUTBOX --max-bytes 10737418240 --discard new"
	if !strings.Contains(out.String(), "--stream-max-bytes 10737418240, the stream has unlimited") || !strings.Contains(out.String(), edit) {
		t.Errorf("check output lacks the difference and %q:\n%s", edit, out.String())
	}
	t.Logf("jetbox check:\n%s", out.String())
	p := f.start("JETBOX_STREAM_MAX_BYTES=10GiB", "JETBOX_STREAM_DISCARD=new")
	f.waitStreaming(p)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d:\n%s", code, p.tail(20))
	}
	if !strings.Contains(p.logText(), edit) {
		t.Errorf("jetbox run did not log %q:\n%s", edit, p.tail(30))
	}
	s, err := f.js.Stream(ctxT(t, 10*time.Second), "OUTBOX")
	must(t, err)
	if c := s.CachedInfo().Config; c.MaxBytes != -1 || c.Discard != jetstream.DiscardOld {
		t.Errorf("jetbox run changed the stream: max_bytes %d, discard %s", c.MaxBytes, c.Discard)
	}
}

// TestRunCreatesR3OnCluster: `jetbox run` against the three-node cluster
// helper, no stream flag: the stream it creates is R3 on all three servers,
// with the 1-second duplicate window of exactly-once mode.
func TestRunCreatesR3OnCluster(t *testing.T) {
	f := newFixture(t)
	c := testenv.StartCluster(t, 3)
	f.natURL = c.Nodes[0].URL // one URL: the others come from the server's INFO
	_, f.js = c.Connect(t)
	f.env = withoutEnv(f.env, "JETBOX_DUPLICATE_WINDOW")
	p := f.start("JETBOX_DELIVERY=exactly-once")
	f.waitStreaming(p)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d:\n%s", code, p.tail(20))
	}
	s, err := f.js.Stream(ctxT(t, 10*time.Second), "OUTBOX")
	must(t, err)
	info := s.CachedInfo()
	t.Logf("created: replicas=%d retention=%s max_age=%s max_bytes=%d duplicates=%s peers=%d", info.Config.Replicas, info.Config.Retention,
		info.Config.MaxAge, info.Config.MaxBytes, info.Config.Duplicates, len(info.Cluster.Replicas)+1)
	if info.Config.Replicas != 3 || len(info.Cluster.Replicas) != 2 || info.Config.Duplicates != sink.ExactlyOnceDuplicateWindow {
		t.Fatalf("stream %+v, cluster %+v", info.Config, info.Cluster)
	}
}

// TestDedupOnExactlyOnceStream: a stream jetbox created in exactly-once
// mode (its 1s window), then run in dedup mode with no --duplicate-window:
// jetbox run warns that dedup mode relies on a window of --max-outage, with
// the nats stream edit line, and does not change the stream.
func TestDedupOnExactlyOnceStream(t *testing.T) {
	f := newFixture(t)
	f.env = withoutEnv(f.env, "JETBOX_DUPLICATE_WINDOW")
	p := f.start("JETBOX_DELIVERY=exactly-once")
	f.waitStreaming(p)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d:\n%s", code, p.tail(20))
	}
	p = f.start("JETBOX_DELIVERY=dedup")
	f.waitStreaming(p)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d:\n%s", code, p.tail(20))
	}
	for _, want := range []string{`stream \"OUTBOX\" has a duplicate window of 1s, shorter than the 10m0s dedup mode relies on`, "nats stream edit OUTBOX --dupe-window 10m0s"} {
		if !strings.Contains(p.logText(), want) {
			t.Errorf("jetbox run (dedup) did not log %q:\n%s", want, p.tail(30))
		}
	}
	s, err := f.js.Stream(ctxT(t, 10*time.Second), "OUTBOX")
	must(t, err)
	if d := s.CachedInfo().Config.Duplicates; d != sink.ExactlyOnceDuplicateWindow {
		t.Errorf("the stream's window is %s, want %s (jetbox does not change a stream)", d, sink.ExactlyOnceDuplicateWindow)
	}
}
