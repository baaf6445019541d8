package sink_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// TestStreamSpecSingleServer: on a single server the stream jetbox creates
// is R1 in auto mode and carries the limits given; check says what it
// would create first; a stream that then differs from the flags is
// reported (check and EnsureStream) with the nats stream edit line, and
// not changed; once edited as that line says, nothing differs.
func TestStreamSpecSingleServer(t *testing.T) {
	n := testenv.StartNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := baseConfig()
	cfg.StreamSpec = sink.StreamSpec{MaxAge: 240 * time.Hour, MaxBytes: 1 << 30, MaxMsgs: 5_000_000, Discard: jetstream.DiscardOld,
		Given: map[string]bool{"max-age": true, "max-bytes": true, "max-msgs": true, "discard": true, "duplicate-window": true}}
	p := newPublisher(t, n, cfg)
	if r, why := p.AutoReplicas(); r != 1 {
		t.Fatalf("AutoReplicas on a single server = %d (%s), want 1", r, why)
	}
	created := check.Named(p.Check(ctx, 10*time.Minute), "nats.stream")
	if len(created) != 1 || created[0].Severity != check.Create ||
		!strings.Contains(created[0].What, "1 replica(s)") || !strings.Contains(created[0].What, "max age 240h0m0s, max bytes 1073741824, max messages 5000000, discard old, duplicate window 1m0s") {
		t.Fatalf("check before the stream exists: %+v", created)
	}
	if _, err := p.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	_, js := n.Connect(t)
	s, err := js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	got := s.CachedInfo().Config
	t.Logf("created: replicas=%d retention=%s max_age=%s max_bytes=%d max_msgs=%d discard=%s dupe=%s",
		got.Replicas, got.Retention, got.MaxAge, got.MaxBytes, got.MaxMsgs, got.Discard, got.Duplicates)
	if got.Replicas != 1 || got.Retention != jetstream.LimitsPolicy || got.MaxAge != 240*time.Hour || got.MaxBytes != 1<<30 ||
		got.MaxMsgs != 5_000_000 || got.Discard != jetstream.DiscardOld || got.Storage != jetstream.FileStorage || got.Duplicates != time.Minute {
		t.Fatalf("stream created with %+v", got)
	}
	if fs := check.Named(p.Check(ctx, 10*time.Minute), "nats.stream_config"); len(fs) != 1 || fs[0].Severity != check.Info {
		t.Fatalf("check on the stream as created: %+v", fs)
	}

	// Other flags against the same stream: reported, not applied.
	cfg.DuplicateWindow = 5 * time.Minute
	cfg.StreamSpec = sink.StreamSpec{Replicas: 1, MaxAge: 720 * time.Hour, MaxBytes: 2 << 30, MaxMsgs: -1, Discard: jetstream.DiscardNew, Storage: jetstream.MemoryStorage,
		Given: map[string]bool{"replicas": true, "max-age": true, "max-bytes": true, "max-msgs": true, "discard": true, "storage": true, "duplicate-window": true}}
	q := newPublisher(t, n, cfg)
	var drift *check.Finding
	for _, f := range check.Named(q.Check(ctx, 10*time.Minute), "nats.stream_config") {
		if f.Severity == check.Warning {
			drift = &f
		}
	}
	const edit = "nats stream edit OUTBOX --max-age 720h0m0s --max-bytes 2147483648 --max-msgs -1 --discard new --dupe-window 5m0s"
	if drift == nil || !strings.Contains(drift.Hint, edit) || !strings.Contains(drift.Hint, "storage cannot be edited") ||
		!strings.Contains(drift.What, "--stream-max-age 720h0m0s, the stream has 240h0m0s") {
		t.Fatalf("check does not report the difference with %q: %+v", edit, drift)
	}
	t.Logf("check: %s; fix: %s", drift.What, drift.Hint)
	if _, err := q.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	s, err = js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	if c := s.CachedInfo().Config; c.MaxAge != 240*time.Hour || c.Discard != jetstream.DiscardOld || c.Duplicates != time.Minute {
		t.Fatalf("EnsureStream changed the existing stream: %+v", c)
	}

	// The edit the fix names (what `nats stream edit` sends), then no difference left but storage.
	c := s.CachedInfo().Config
	c.MaxAge, c.MaxBytes, c.MaxMsgs, c.Discard, c.Duplicates = 720*time.Hour, 2<<30, -1, jetstream.DiscardNew, 5*time.Minute
	if _, err := js.UpdateStream(ctx, c); err != nil {
		t.Fatal(err)
	}
	s, _ = js.Stream(ctx, "OUTBOX")
	if d := q.Drift(s.CachedInfo().Config); len(d) != 1 || d[0].Flag != "stream-storage" {
		t.Fatalf("after the edit: %+v", d)
	}

	// Defaults compare nothing: a stream managed elsewhere is not reported for flags nobody gave.
	cfg.StreamSpec = sink.StreamSpec{}
	if d := newPublisher(t, n, cfg).Drift(s.CachedInfo().Config); len(d) != 0 {
		t.Fatalf("no flag given, differences reported: %+v", d)
	}
}

// TestStreamSpecCluster: on the three-node cluster helper, a client that
// knows only one server's URL learns the cluster from its INFO, and the
// stream jetbox creates in auto mode is R3, placed on all three servers;
// five replicas fail with the fix.
func TestStreamSpecCluster(t *testing.T) {
	c := testenv.StartCluster(t, 3)
	nc, err := nats.Connect(c.Nodes[0].URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// INFO with connect_urls arrives with the connection, or just after it
	// when the routes settle: await it, bounded.
	deadline := time.Now().Add(10 * time.Second)
	for len(nc.Servers()) < 3 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	p, err := sink.New(nc, baseConfig(), zerolog.New(zerolog.NewTestWriter(t)))
	if err != nil {
		t.Fatal(err)
	}
	if r, why := p.AutoReplicas(); r != 3 {
		t.Fatalf("AutoReplicas on a 3-node cluster = %d (%s; servers %q)", r, why, nc.Servers())
	}
	if fs := check.Named(p.Check(ctx, 10*time.Minute), "nats.stream"); len(fs) != 1 || !strings.Contains(fs[0].What, "3 replica(s)") {
		t.Fatalf("check before the stream exists: %+v", fs)
	}
	if _, err := p.EnsureStream(ctx); err != nil {
		t.Fatal(err)
	}
	c.WaitStreamCurrent("OUTBOX")
	js, _ := jetstream.New(nc)
	s, err := js.Stream(ctx, "OUTBOX")
	if err != nil {
		t.Fatal(err)
	}
	info := s.CachedInfo()
	if info.Config.Replicas != 3 || info.Cluster == nil || len(info.Cluster.Replicas) != 2 {
		t.Fatalf("stream created with %d replicas, cluster %+v", info.Config.Replicas, info.Cluster)
	}
	if fs := check.Named(p.Check(ctx, 10*time.Minute), "nats.replicas"); len(fs) != 0 {
		t.Fatalf("check warns about the R3 stream it created: %+v", fs)
	}

	cfg := baseConfig()
	cfg.Stream, cfg.SubjectPrefix = "WIDE", "wide"
	cfg.StreamSpec = sink.StreamSpec{Replicas: 5, Given: map[string]bool{"replicas": true}}
	q, err := sink.New(nc, cfg, zerolog.New(zerolog.NewTestWriter(t)))
	if err != nil {
		t.Fatal(err)
	}
	_, err = q.EnsureStream(ctx)
	if err == nil || !strings.Contains(err.Error(), "set --stream-replicas") {
		t.Fatalf("R5 on three servers: %v", err)
	}
	t.Logf("R5 on three servers: %v", err)
}
