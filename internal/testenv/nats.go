package testenv

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/natsembed"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATS is an embedded nats-server with JetStream and a file store; it can be
// stopped and started again on the same port and store.
type NATS struct {
	t       testing.TB
	opts    natsembed.Options
	srv     *server.Server
	ext     *exec.Cmd // when JETBOX_NATS_BIN names a nats-server binary
	extDone chan struct{}
	// URL is the client URL, stable across restarts.
	URL string
}

// NATSOption tunes the server before it starts.
type NATSOption func(*natsembed.Options)

// WithMaxPayload sets the server's max_payload.
func WithMaxPayload(n int32) NATSOption { return func(o *natsembed.Options) { o.MaxPayload = n } }

// WithTLS serves TLS only (client certificates required when ClientCAs is set).
func WithTLS(c *tls.Config) NATSOption { return func(o *natsembed.Options) { o.TLS = c } }

// WithUser requires a user and password.
func WithUser(user, password string) NATSOption {
	return func(o *natsembed.Options) { o.Username, o.Password = user, password }
}

// WithPublishAllow lets the user of WithUser publish only to these subjects.
func WithPublishAllow(subjects ...string) NATSOption {
	return func(o *natsembed.Options) { o.PublishAllow = subjects }
}

// WithSubscribeAllow lets the user of WithUser subscribe only to these subjects.
func WithSubscribeAllow(subjects ...string) NATSOption {
	return func(o *natsembed.Options) { o.SubscribeAllow = subjects }
}

// WithJetStreamDomain names the server's JetStream domain.
func WithJetStreamDomain(domain string) NATSOption {
	return func(o *natsembed.Options) { o.JetStreamDomain = domain }
}

// StartNATS starts a server for the test; cleanup shuts it down.
func StartNATS(t testing.TB, opts ...NATSOption) *NATS {
	t.Helper()
	store, err := os.MkdirTemp("", "jetbox-nats-")
	if err != nil {
		t.Fatal(err)
	}
	n := &NATS{t: t, opts: natsembed.Options{Port: FreePort(t), StoreDir: store}}
	for _, o := range opts {
		o(&n.opts)
	}
	n.URL = fmt.Sprintf("nats://127.0.0.1:%d", n.opts.Port)
	t.Cleanup(func() { n.Stop(); _ = os.RemoveAll(store) })
	n.Start()
	return n
}

// External reports whether the tests run a nats-server binary
// ($JETBOX_NATS_BIN, another server version) instead of the embedded one.
func External() bool { return os.Getenv("JETBOX_NATS_BIN") != "" }

// Start starts the server (again) and waits until it serves clients.
func (n *NATS) Start() {
	n.t.Helper()
	if bin := os.Getenv("JETBOX_NATS_BIN"); bin != "" {
		n.startExternal(bin)
		return
	}
	srv, err := natsembed.Start(n.opts)
	if err != nil {
		n.t.Fatal(err)
	}
	n.srv = srv
}

// startExternal runs a nats-server binary with the same options.
func (n *NATS) startExternal(bin string) {
	if n.opts.TLS != nil || n.opts.PublishAllow != nil || n.opts.SubscribeAllow != nil || n.opts.JetStreamDomain != "" {
		n.t.Skip("TLS, permission and domain tests run against the embedded server only")
	}
	conf := fmt.Sprintf("listen: 127.0.0.1:%d\njetstream { store_dir: %q }\n", n.opts.Port, n.opts.StoreDir)
	if n.opts.MaxPayload > 0 {
		conf += fmt.Sprintf("max_payload: %d\n", n.opts.MaxPayload)
	}
	if n.opts.Username != "" {
		conf += fmt.Sprintf("authorization { user: %q, password: %q }\n", n.opts.Username, n.opts.Password)
	}
	path := filepath.Join(n.opts.StoreDir, "nats.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		n.t.Fatal(err)
	}
	cmd := exec.Command(bin, "-c", path)
	if err := cmd.Start(); err != nil {
		n.t.Fatalf("start %s: %v", bin, err)
	}
	n.ext, n.extDone = cmd, make(chan struct{})
	go func(done chan struct{}) { _ = cmd.Wait(); close(done) }(n.extDone)
	deadline := time.Now().Add(30 * time.Second)
	for {
		nc, err := nats.Connect(n.URL, nats.UserInfo(n.opts.Username, n.opts.Password))
		if err == nil {
			js, _ := jetstream.New(nc)
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_, err = js.AccountInfo(ctx)
			cancel()
			nc.Close()
			if err == nil {
				return
			}
		}
		select {
		case <-n.extDone:
			n.t.Fatalf("%s exited at start", bin)
		default:
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("%s not ready after 30s: %v", bin, err)
		}
		time.Sleep(20 * time.Millisecond) // readiness has no event to wait on
	}
}

// Stop shuts the server down and waits until it is gone.
func (n *NATS) Stop() {
	if n.ext != nil {
		_ = n.ext.Process.Signal(syscall.SIGTERM)
		select {
		case <-n.extDone:
		case <-time.After(30 * time.Second):
			_ = n.ext.Process.Kill()
			<-n.extDone
		}
		n.ext = nil
		return
	}
	if n.srv == nil {
		return
	}
	natsembed.Stop(n.srv)
	n.srv = nil
}

// Restart stops and starts the server.
func (n *NATS) Restart() {
	n.t.Helper()
	n.Stop()
	n.Start()
}

// RestartWith stops the server and starts it again with opts applied.
func (n *NATS) RestartWith(opts ...NATSOption) {
	n.t.Helper()
	n.Stop()
	for _, o := range opts {
		o(&n.opts)
	}
	n.Start()
}

// ConnectionNames returns the names of the clients connected to the
// embedded server.
func (n *NATS) ConnectionNames(t testing.TB) []string {
	t.Helper()
	if n.srv == nil {
		t.Skip("connection names are read from the embedded server")
	}
	cz, err := n.srv.Connz(&server.ConnzOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, c := range cz.Conns {
		names = append(names, c.Name)
	}
	return names
}

// Connect returns a client connection closed at cleanup, and its JetStream.
func (n *NATS) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	opts := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond)}
	if n.opts.Username != "" && n.opts.TLS == nil {
		opts = append(opts, nats.UserInfo(n.opts.Username, n.opts.Password))
	}
	if len(n.opts.SubscribeAllow) > 0 { // the user's replies go where it may subscribe
		opts = append(opts, nats.CustomInboxPrefix(strings.TrimSuffix(n.opts.SubscribeAllow[0], ".>")))
	}
	nc, err := nats.Connect(n.URL, opts...)
	if err != nil {
		t.Fatalf("connect to nats: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if n.opts.JetStreamDomain != "" {
		js, err = jetstream.NewWithDomain(nc, n.opts.JetStreamDomain)
	}
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// StreamMsg is one stored message as a test sees it.
type StreamMsg struct {
	Seq     uint64
	Subject string
	ID      string // Nats-Msg-Id
	Header  nats.Header
	Data    []byte
}

// ReadStream returns every message of the stream in stream order. With
// keepData false, Data and Header are dropped to save memory on big streams.
func ReadStream(t testing.TB, js jetstream.JetStream, stream string, keepData bool) []StreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	total := info.State.Msgs
	out := make([]StreamMsg, 0, total)
	if total == 0 {
		return out
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(2000))
	if err != nil {
		t.Fatal(err)
	}
	defer it.Stop()
	for uint64(len(out)) < total {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			t.Fatalf("read stream %s after %d of %d messages: %v", stream, len(out), total, err)
		}
		md, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		sm := StreamMsg{Seq: md.Sequence.Stream, Subject: m.Subject(), ID: m.Headers().Get("Nats-Msg-Id")}
		if keepData {
			sm.Header, sm.Data = m.Headers(), append([]byte(nil), m.Data()...)
		}
		out = append(out, sm)
	}
	return out
}

// StreamCount returns the number of messages stored in the stream, or 0 when
// it does not exist yet.
func StreamCount(js jetstream.JetStream, stream string) (uint64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}
