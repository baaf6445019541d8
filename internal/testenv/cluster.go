package testenv

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Cluster is a JetStream cluster of embedded nats-servers on loopback, routed
// to each other. Each node keeps its client port, cluster port and file store
// across Kill and Restart.
type Cluster struct {
	t     testing.TB
	Name  string
	Nodes []*ClusterNode
}

// ClusterNode is one server of a Cluster.
type ClusterNode struct {
	Name        string
	URL         string // client URL, stable across restarts
	port, cport int
	store       string
	routes      []*url.URL
	srv         *server.Server // nil while killed
}

// Running reports whether the node's server is up.
func (n *ClusterNode) Running() bool { return n.srv != nil }

// StartCluster starts a cluster of size servers (JetStream file store in
// t.TempDir()) and waits until it has a meta leader that knows every peer and
// every server is current. Cleanup shuts it down.
func StartCluster(t testing.TB, size int) *Cluster {
	t.Helper()
	SkipIfShort(t)
	c := &Cluster{t: t, Name: "jetbox-test"}
	for i := 0; i < size; i++ {
		n := &ClusterNode{Name: fmt.Sprintf("n%d", i+1), port: FreePort(t), cport: FreePort(t), store: t.TempDir()}
		n.URL = fmt.Sprintf("nats://127.0.0.1:%d", n.port)
		c.Nodes = append(c.Nodes, n)
	}
	for _, n := range c.Nodes {
		var others []string
		for _, m := range c.Nodes {
			if m != n {
				others = append(others, fmt.Sprintf("nats://127.0.0.1:%d", m.cport))
			}
		}
		n.routes = server.RoutesFromStr(strings.Join(others, ","))
	}
	t.Cleanup(func() {
		for _, n := range c.Nodes {
			c.Kill(n)
		}
	})
	for _, n := range c.Nodes {
		c.start(n)
	}
	c.WaitReady()
	return c
}

// URLs is every node's client URL, comma-separated (what JETBOX_NATS_URL takes).
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL
	}
	return strings.Join(urls, ",")
}

// Connect returns a client connection to the cluster (reconnecting to any
// node, forever), closed at cleanup, and its JetStream.
func (c *Cluster) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(c.URLs(), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("connect to the nats cluster: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

func (c *Cluster) start(n *ClusterNode) {
	c.t.Helper()
	opts := &server.Options{
		ServerName: n.Name, Host: "127.0.0.1", Port: n.port,
		JetStream: true, StoreDir: n.store,
		Cluster: server.ClusterOpts{Name: c.Name, Host: "127.0.0.1", Port: n.cport},
		Routes:  n.routes,
		NoLog:   true, NoSigs: true, MaxControlLine: 4096,
	}
	// Quiet by default; JETBOX_NATS_LOG_DIR=<dir> keeps each server's debug
	// log there (<dir>/<test>-n1.log, ...), for post-mortems of a failed test.
	if dir := os.Getenv("JETBOX_NATS_LOG_DIR"); dir != "" {
		name := strings.NewReplacer("/", "_", " ", "_").Replace(c.t.Name()) + "-" + n.Name + ".log"
		opts.NoLog, opts.Debug, opts.Logtime, opts.LogFile = false, true, true, filepath.Join(dir, name)
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		c.t.Fatalf("nats server %s: %v", n.Name, err)
	}
	if !opts.NoLog {
		srv.ConfigureLogger()
	}
	srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		c.t.Fatalf("nats server %s not ready after 30s", n.Name)
	}
	n.srv = srv
}

// WaitReady waits until the cluster has a meta leader that counts every node
// as a peer, every running node routes to every other running node, and every
// running node's meta state is current.
func (c *Cluster) WaitReady() {
	c.t.Helper()
	WaitFor(c.t, time.Minute, func() error {
		var leader *ClusterNode
		running := 0
		for _, n := range c.Nodes {
			if n.srv == nil {
				continue
			}
			running++
			if n.srv.JetStreamIsLeader() {
				leader = n
			}
		}
		if leader == nil {
			return errors.New("no JetStream meta leader")
		}
		if peers := len(leader.srv.JetStreamClusterPeers()); peers != len(c.Nodes) {
			return fmt.Errorf("meta leader %s knows %d peers, want %d", leader.Name, peers, len(c.Nodes))
		}
		for _, n := range c.Nodes {
			if n.srv == nil {
				continue
			}
			if r := n.srv.NumRoutes(); r < running-1 {
				return fmt.Errorf("%s routes to %d servers, want %d", n.Name, r, running-1)
			}
			if !n.srv.JetStreamIsCurrent() {
				return fmt.Errorf("%s is not current with the meta leader", n.Name)
			}
		}
		return nil
	})
}

// StreamLeader waits until one running node leads the stream (global
// account) and returns it.
func (c *Cluster) StreamLeader(stream string) *ClusterNode {
	c.t.Helper()
	var leader *ClusterNode
	WaitFor(c.t, time.Minute, func() error {
		leader = nil
		for _, n := range c.Nodes {
			if n.srv != nil && n.srv.JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, stream) {
				if leader != nil {
					return fmt.Errorf("stream %s: both %s and %s claim to lead", stream, leader.Name, n.Name)
				}
				leader = n
			}
		}
		if leader == nil {
			return fmt.Errorf("stream %s has no leader (JETBOX_NATS_LOG_DIR=<dir> writes the servers' debug logs there)", stream)
		}
		return nil
	})
	return leader
}

// WaitStreamCurrent waits until the stream has a leader, every running
// node's replica of it is current (caught up with the leader), and every
// running node knows the leader's interest in the stream's subjects. The
// interest crosses the routes after the election: a publish to another node
// before it arrives gets no responders ("nats: no response from stream").
func (c *Cluster) WaitStreamCurrent(stream string) {
	c.t.Helper()
	leader := c.StreamLeader(stream)
	subjects := c.streamSubjects(leader, stream)
	WaitFor(c.t, time.Minute, func() error {
		for _, n := range c.Nodes {
			for _, subj := range subjects {
				if n.srv != nil && !n.srv.GlobalAccount().SubscriptionInterest(subj) {
					return fmt.Errorf("%s has no interest in %s yet (stream %s)", n.Name, subj, stream)
				}
			}
		}
		return nil
	})
	WaitFor(c.t, time.Minute, func() error {
		for _, n := range c.Nodes {
			if n.srv != nil && !n.srv.JetStreamIsStreamCurrent(server.DEFAULT_GLOBAL_ACCOUNT, stream) {
				return fmt.Errorf("%s's replica of stream %s is not current (JETBOX_NATS_LOG_DIR=<dir> writes the servers' debug logs there)", n.Name, stream)
			}
		}
		return nil
	})
}

// Kill shuts the node's server down at once (no lame-duck mode: its client
// and route connections drop; the server steps down the raft groups it leads
// on its way out) and waits until it is gone.
func (c *Cluster) Kill(n *ClusterNode) {
	if n.srv == nil {
		return
	}
	n.srv.Shutdown()
	n.srv.WaitForShutdown()
	n.srv = nil
}

// Restart starts a killed node again on the same ports and store and waits
// until it has rejoined: routed to the others and current with the meta leader.
func (c *Cluster) Restart(n *ClusterNode) {
	c.t.Helper()
	if n.srv != nil {
		c.t.Fatalf("nats server %s is running", n.Name)
	}
	c.start(n)
	c.WaitReady()
}

// streamSubjects returns one literal subject for each of the stream's subject
// filters (wildcard tokens replaced by "x"), read from the leader.
func (c *Cluster) streamSubjects(leader *ClusterNode, stream string) []string {
	c.t.Helper()
	nc, err := nats.Connect(leader.URL, nats.IgnoreDiscoveredServers())
	if err != nil {
		c.t.Fatalf("connect to %s: %v", leader.Name, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		c.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		c.t.Fatalf("look up stream %s on %s: %v", stream, leader.Name, err)
	}
	var subjects []string
	for _, filter := range s.CachedInfo().Config.Subjects {
		tokens := strings.Split(filter, ".")
		for i, tok := range tokens {
			if tok == "*" || tok == ">" {
				tokens[i] = "x"
			}
		}
		subjects = append(subjects, strings.Join(tokens, "."))
	}
	return subjects
}
