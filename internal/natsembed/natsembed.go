// Package natsembed runs a NATS server with JetStream inside the jetbox
// process (github.com/nats-io/nats-server/v2), for the demo and for tests.
package natsembed

import (
	"crypto/tls"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Options configure an embedded server.
type Options struct {
	Host       string      // default 127.0.0.1
	Port       int         // 0: a free port
	StoreDir   string      // JetStream file store
	MaxPayload int32       // 0: the server default (1 MiB)
	TLS        *tls.Config // serve TLS only; with ClientCAs set, client certificates are required
	Username   string      // require this user and Password
	Password   string
	// PublishAllow, with Username, limits what the user may publish to
	// these subjects (plus replies to its requests).
	PublishAllow []string
	// SubscribeAllow, with Username, limits what the user may subscribe
	// to (nil: anything).
	SubscribeAllow []string
	// JetStreamDomain names the server's JetStream domain ($JS.<domain>.API).
	JetStreamDomain string
}

// Start starts a server and waits until it serves clients.
func Start(o Options) (*server.Server, error) {
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.Port == 0 {
		l, err := net.Listen("tcp", net.JoinHostPort(o.Host, "0"))
		if err != nil {
			return nil, err
		}
		o.Port = l.Addr().(*net.TCPAddr).Port
		l.Close()
	}
	so := &server.Options{
		Host: o.Host, Port: o.Port, JetStream: true, StoreDir: o.StoreDir, MaxPayload: o.MaxPayload,
		NoLog: true, NoSigs: true, MaxControlLine: 4096, Username: o.Username, Password: o.Password,
		JetStreamDomain: o.JetStreamDomain,
	}
	if o.PublishAllow != nil || o.SubscribeAllow != nil {
		pub, sub := o.PublishAllow, o.SubscribeAllow
		if pub == nil {
			pub = []string{">"}
		}
		if sub == nil {
			sub = []string{">"}
		}
		so.Username, so.Password = "", ""
		so.Users = []*server.User{{Username: o.Username, Password: o.Password, Permissions: &server.Permissions{
			Publish: &server.SubjectPermission{Allow: pub}, Subscribe: &server.SubjectPermission{Allow: sub},
		}}}
	}
	if o.TLS != nil {
		so.TLS, so.TLSConfig, so.TLSVerify, so.TLSTimeout = true, o.TLS, o.TLS.ClientCAs != nil, 2
	}
	srv, err := server.NewServer(so)
	if err != nil {
		return nil, fmt.Errorf("nats server: %w", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(30 * time.Second) {
		srv.Shutdown()
		return nil, fmt.Errorf("nats server on %s not ready after 30s", net.JoinHostPort(o.Host, strconv.Itoa(o.Port)))
	}
	return srv, nil
}

// Stop shuts the server down and waits until it is gone.
func Stop(srv *server.Server) {
	srv.Shutdown()
	srv.WaitForShutdown()
}
