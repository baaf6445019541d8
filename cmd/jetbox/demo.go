package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/alecthomas/kong"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/natsembed"
	"github.com/jetbox-dev/jetbox/internal/pgcluster"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// demoCmd is `jetbox demo`: a throwaway Postgres and an embedded NATS server,
// the real forwarder between them, sample orders, and a live consumer.
type demoCmd struct {
	Orders   int           `default:"5" help:"Sample orders to write."`
	Interval time.Duration `default:"700ms" help:"Pause between sample orders."`
	Once     bool          `help:"Exit once the sample orders arrived (for scripts), instead of running until Ctrl-C."`
}

// outboxDDL is the default outbox contract (the README's DDL).
const outboxDDL = decoder.OutboxDDL

// emitFunctionDDL is jetbox_emit, the producer side of the messages
// source (docs/routing.md): one call emits one outbox event as a
// transactional logical decoding message, and no table grows.
const emitFunctionDDL = `CREATE FUNCTION jetbox_emit(aggregate_type text, aggregate_id text, event_type text,
                            payload jsonb, headers jsonb DEFAULT NULL)
RETURNS uuid LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  event_id uuid := gen_random_uuid();
BEGIN
  PERFORM pg_logical_emit_message(true, 'jetbox', jsonb_build_object(
    'id', event_id, 'aggregate_type', aggregate_type, 'aggregate_id', aggregate_id,
    'event_type', event_type, 'payload', payload, 'headers', headers)::text);
  RETURN event_id;
END
$$`

// demoSchema is the demo's business table, the outbox and jetbox_emit.
const demoSchema = `CREATE TABLE orders (
  id       bigserial   PRIMARY KEY,
  customer text        NOT NULL,
  total    numeric     NOT NULL,
  placed   timestamptz NOT NULL DEFAULT now()
);
` + outboxDDL + ";\n" + emitFunctionDDL

// demoOrder writes a business row and its outbox row in one transaction.
const demoOrder = `WITH o AS (
  INSERT INTO orders (customer, total) VALUES ($1, $2) RETURNING id, customer, total
)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
SELECT 'order', o.id::text, 'OrderPlaced', jsonb_build_object('order_id', o.id, 'customer', o.customer, 'total', o.total),
       jsonb_build_object('traceparent', '00-' || md5(o.id::text) || '-' || substr(md5(o.customer), 1, 16) || '-01')
FROM o`

// demoOrderMessage writes a business row and emits its event with
// jetbox_emit in one transaction: the same event, no outbox row.
const demoOrderMessage = `WITH o AS (
  INSERT INTO orders (customer, total) VALUES ($1, $2) RETURNING id, customer, total
)
SELECT jetbox_emit('order', o.id::text, 'OrderPlaced', jsonb_build_object('order_id', o.id, 'customer', o.customer, 'total', o.total),
       jsonb_build_object('traceparent', '00-' || md5(o.id::text) || '-' || substr(md5(o.customer), 1, 16) || '-01'))
FROM o`

func (d *demoCmd) run(ctx context.Context, stdout, stderr io.Writer) int {
	say := func(format string, a ...any) { fmt.Fprintf(stdout, format+"\n", a...) }
	fail := func(code int, what string, err error) int {
		fmt.Fprintln(stderr, "jetbox demo:", what+err.Error())
		return code
	}
	bin, err := pgcluster.FindBinDir()
	if err != nil {
		return fail(exitConfig, "", err)
	}
	say("jetbox demo: starting a throwaway PostgreSQL (%s) and an embedded NATS server with JetStream...", bin)
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	srv, err := startDemoServers(sctx, bin)
	defer srv.close()
	if err != nil {
		return fail(exitFailure, "", err)
	}
	say("  postgres  %s  (tables orders, outbox)", srv.cluster.DSN)
	say("  nats      %s  (stream OUTBOX, subjects outbox.>)", srv.natsURL)
	say("  jetbox    http://%s/metrics, /readyz", srv.httpAddr)

	// The real forwarder, configured exactly as `jetbox run` would be.
	cfg, err := demoConfig(srv)
	if err != nil {
		printProblems(stderr, "configuration", err)
		return exitConfig
	}
	fctx, stopForwarder := context.WithCancel(context.Background())
	forwarderDone := make(chan int, 1)
	go func() { forwarderDone <- run(fctx, cfg, stderr, stderr) }()
	defer func() {
		stopForwarder()
		<-forwarderDone
	}()
	received, printMu, stopConsumer, code, err := d.consume(ctx, sctx, srv.natsURL, forwarderDone, stdout)
	if err != nil {
		return fail(code, "", err)
	}
	defer stopConsumer()

	say("\nWriting %d sample orders, each a business row and its event in one transaction: even ones with an outbox row,\nodd ones with SELECT jetbox_emit(...) (a logical decoding message, no table); each arrives from a JetStream consumer:\n", d.Orders)
	if code, done := d.writeOrders(ctx, srv.conn, forwarderDone, stderr); done {
		return code
	}
	for got := 0; got < d.Orders; got++ {
		select {
		case <-received:
		case <-ctx.Done():
			return exitOK
		case <-time.After(30 * time.Second):
			fmt.Fprintf(stderr, "jetbox demo: only %d of %d events arrived within 30s\n", got, d.Orders)
			return exitFailure
		}
	}
	printMu.Lock()
	say("\nAll %d events arrived. Try next, in another terminal:", d.Orders)
	say("  psql %q -c \"INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '42', 'OrderShipped', '{\\\"carrier\\\": \\\"ups\\\"}')\"", srv.cluster.DSN)
	say("  psql %q -c \"SELECT jetbox_emit('order', '42', 'OrderDelivered', '{}')\"", srv.cluster.DSN)
	say("  nats --server %s sub 'outbox.>'          # live, as jetbox publishes", srv.natsURL)
	say("  nats --server %s stream view OUTBOX      # everything stored", srv.natsURL)
	say("  (nats is the NATS CLI: go install github.com/nats-io/natscli/nats@v0.5.0)")
	printMu.Unlock()
	if d.Once {
		return exitOK
	}
	say("\nRunning until Ctrl-C; inserted rows show up here as they arrive.")
	select {
	case <-ctx.Done():
		say("\nStopping: forwarder, NATS and Postgres are shut down and their files removed.")
	case code := <-forwarderDone:
		fmt.Fprintln(stderr, "jetbox demo: the forwarder stopped")
		return code
	}
	return exitOK
}

// demoServers are the demo's throwaway Postgres (with its tables) and
// embedded NATS server, and the address for jetbox's HTTP endpoints.
type demoServers struct {
	cluster  *pgcluster.Cluster
	store    string
	nats     *server.Server
	natsURL  string
	httpAddr string
	conn     *pgx.Conn
}

// startDemoServers starts the demo's servers; close removes what started,
// also after an error.
func startDemoServers(ctx context.Context, bin string) (*demoServers, error) {
	s := &demoServers{}
	var err error
	if s.cluster, err = pgcluster.New(pgcluster.Options{BinDir: bin}); err != nil {
		return s, err
	}
	if err := s.cluster.Start(ctx); err != nil {
		return s, err
	}
	if s.store, err = os.MkdirTemp("", "jetbox-demo-nats-"); err != nil {
		return s, err
	}
	if s.nats, err = natsembed.Start(natsembed.Options{StoreDir: s.store}); err != nil {
		return s, err
	}
	s.natsURL = s.nats.ClientURL()
	if s.httpAddr, err = freeAddr(); err != nil {
		return s, err
	}
	if s.conn, err = pgx.Connect(ctx, s.cluster.DSN); err != nil {
		return s, err
	}
	if _, err := s.conn.Exec(ctx, demoSchema); err != nil {
		return s, fmt.Errorf("create tables: %w", err)
	}
	return s, nil
}

func (s *demoServers) close() {
	if s.conn != nil {
		s.conn.Close(context.Background())
	}
	if s.nats != nil {
		natsembed.Stop(s.nats)
	}
	if s.store != "" {
		os.RemoveAll(s.store)
	}
	if s.cluster != nil {
		s.cluster.Remove()
	}
}

// demoConfig is the configuration `jetbox run` would have with the demo's
// flags.
func demoConfig(srv *demoServers) (Config, error) {
	var c cli
	k, err := kong.New(&c, kong.Name("jetbox"), kong.Vars(flagVars))
	if err == nil {
		_, err = k.Parse([]string{"run", "--postgres-url=" + srv.cluster.DSN, "--nats-url=" + srv.natsURL,
			"--http-addr=" + srv.httpAddr, "--duplicate-window=10m", "--log-format=console", "--log-level=warn", "--source=table,messages"})
	}
	if err != nil {
		return Config{}, err
	}
	return c.Run.Config()
}

// consume prints every event of the stream as it arrives (once the
// forwarder has created the stream), with a signal on received for each;
// printMu keeps the demo's own lines apart from them.
func (d *demoCmd) consume(ctx, sctx context.Context, natsURL string, forwarderDone <-chan int, stdout io.Writer) (received chan struct{}, printMu *sync.Mutex, stop func(), code int, err error) {
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return nil, nil, nil, exitFailure, err
	}
	js, _ := jetstream.New(nc)
	var stream jetstream.Stream
	for stream == nil { // the forwarder creates the stream at start-up
		if stream, err = js.Stream(sctx, "OUTBOX"); err != nil {
			select {
			case code := <-forwarderDone:
				nc.Close()
				return nil, nil, nil, code, errors.New("the forwarder stopped at start-up")
			case <-sctx.Done():
				nc.Close()
				return nil, nil, nil, exitFailure, fmt.Errorf("stream OUTBOX not created: %w", err)
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		nc.Close()
		return nil, nil, nil, exitFailure, err
	}
	received, printMu = make(chan struct{}, 1024), &sync.Mutex{}
	cc, err := cons.Consume(func(m jetstream.Msg) {
		printMu.Lock()
		defer printMu.Unlock()
		printEvent(stdout, m)
		received <- struct{}{}
	})
	if err != nil {
		nc.Close()
		return nil, nil, nil, exitFailure, err
	}
	return received, printMu, func() { cc.Stop(); nc.Close() }, exitOK, nil
}

// writeOrders writes the sample orders, every --interval: even ones with
// an outbox row, odd ones with jetbox_emit. done reports that the demo
// ends, with code.
func (d *demoCmd) writeOrders(ctx context.Context, conn *pgx.Conn, forwarderDone <-chan int, stderr io.Writer) (code int, done bool) {
	customers := []string{"ada", "grace", "linus", "barbara", "ken", "margaret"}
	for i := 0; i < d.Orders; i++ {
		producer := demoOrder
		if i%2 == 1 {
			producer = demoOrderMessage
		}
		if _, err := conn.Exec(ctx, producer, customers[i%len(customers)], 10+7*i); err != nil {
			if ctx.Err() != nil {
				return exitOK, true
			}
			fmt.Fprintln(stderr, "jetbox demo: write order:", err)
			return exitFailure, true
		}
		select {
		case <-ctx.Done():
			return exitOK, true
		case code := <-forwarderDone:
			fmt.Fprintln(stderr, "jetbox demo: the forwarder stopped")
			return code, true
		case <-time.After(d.Interval):
		}
	}
	return exitOK, false
}

// freeAddr returns a free 127.0.0.1 address for the demo's HTTP endpoints.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// printEvent shows one message: subject, headers, payload and how long after
// the commit JetStream stored it.
func printEvent(w io.Writer, m jetstream.Msg) {
	h := m.Headers()
	latency := ""
	if md, err := m.Metadata(); err == nil {
		if ct, err := time.Parse(time.RFC3339Nano, h.Get(format.HeaderCommitTime)); err == nil {
			latency = fmt.Sprintf("  commit→stored %s", md.Timestamp.Sub(ct).Round(10*time.Microsecond))
		}
		latency = fmt.Sprintf("  seq %d%s", md.Sequence.Stream, latency)
	}
	fmt.Fprintf(w, "● %s%s\n", m.Subject(), latency)
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "    %-27s %s\n", k+":", strings.Join(h[k], ","))
	}
	fmt.Fprintf(w, "    payload: %s\n", m.Data())
}
