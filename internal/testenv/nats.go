package testenv

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
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
	t    testing.TB
	opts natsembed.Options
	srv  *server.Server
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

// Start starts the server (again) and waits until it serves clients.
func (n *NATS) Start() {
	n.t.Helper()
	srv, err := natsembed.Start(n.opts)
	if err != nil {
		n.t.Fatal(err)
	}
	n.srv = srv
}

// Stop shuts the server down and waits until it is gone.
func (n *NATS) Stop() {
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

// Connect returns a client connection closed at cleanup, and its JetStream.
func (n *NATS) Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(n.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("connect to nats: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
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
