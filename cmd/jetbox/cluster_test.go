package main

import (
	"math/rand"
	"regexp"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go/jetstream"
)

// TestClusterLeaderKills: a three-node JetStream cluster, an R3 stream, and
// the server leading the stream killed again and again under load from three
// writers (up to 6 kills or 60s; the killed server restarts on the same ports
// and store and rejoins before the next kill). In both delivery modes the
// stream ends equal to the committed rows in commit order: no gap, no
// duplicate. The servers run in-process, so a kill is a Shutdown without
// lame-duck mode: connections drop at once, publishes in flight are lost,
// and the server hands the leadership it holds to a peer on its way out.
func TestClusterLeaderKills(t *testing.T) {
	runsBeside(t)
	for _, mode := range []string{"exactly-once", "dedup"} {
		t.Run(mode, func(t *testing.T) { clusterLeaderKills(t, "JETBOX_DELIVERY="+mode) })
	}
}

// newClusterFixture points a fixture at a three-node JetStream cluster
// holding an R3 OUTBOX stream (allowing atomic batches when atomic is set).
func newClusterFixture(t testing.TB, atomic bool) (*fixture, *testenv.Cluster) {
	f := newFixture(t)
	c := testenv.StartCluster(t, 3)
	f.natURL = c.URLs()
	_, f.js = c.Connect(t)
	_, err := f.js.CreateStream(ctxT(t, 30*time.Second), jetstream.StreamConfig{
		Name: "OUTBOX", Subjects: []string{"outbox.>"}, Storage: jetstream.FileStorage,
		Replicas: 3, Duplicates: 30 * time.Minute, AllowAtomicPublish: atomic,
	})
	must(t, err)
	c.WaitStreamCurrent("OUTBOX")
	return f, c
}

func clusterLeaderKills(t *testing.T, env ...string) {
	f, c := newClusterFixture(t, false)
	// A publish lost with its leader is retried after 3s, not the default 30s.
	f.env = append(append(f.env, "JETBOX_PUBLISH_TIMEOUT=3s"), env...)
	o := f.newOracle()
	p := f.start()
	f.waitStreaming(p)
	l := f.startLoad(3, 5*time.Millisecond, 1_000_000)
	t.Cleanup(l.stop)

	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewSource(seed))
	begin, kills := time.Now(), 0
	var count uint64
	for kills < 6 && time.Since(begin) < 60*time.Second {
		count = f.progress(count, time.Minute)                      // jetbox forwarded something since the last kill
		time.Sleep(time.Duration(rng.Intn(300)) * time.Millisecond) // a random moment, not synchronisation
		leader := c.StreamLeader("OUTBOX")
		c.Kill(leader)
		kills++
		count = f.progress(count, time.Minute) // it carries on with the new leader, on two of three nodes
		c.Restart(leader)
		c.WaitStreamCurrent("OUTBOX")
		t.Logf("kill %d at %s: %s led the stream; %d messages stored; it rejoined", kills, time.Since(begin).Round(time.Millisecond), leader.Name, count)
	}
	t.Logf("%d leader kills in %s (seed %d)", kills, time.Since(begin).Round(time.Millisecond), seed)
	f.finish(l, o)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}
	if m := regexp.MustCompile(`"published":\d+,"duplicates":\d+,"publish_errors":\d+`).FindString(p.logText()); m != "" {
		t.Logf("jetbox: %s", m)
	}
	info, err := f.js.Stream(ctxT(t, 10*time.Second), "OUTBOX")
	must(t, err)
	if r := info.CachedInfo().Config.Replicas; r != 3 {
		t.Fatalf("stream has %d replicas, want 3", r)
	}
}
