package main

import (
	"context"
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
	bin, err := pgcluster.FindBinDir()
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitConfig
	}
	say("jetbox demo: starting a throwaway PostgreSQL (%s) and an embedded NATS server with JetStream...", bin)
	cluster, err := pgcluster.New(pgcluster.Options{BinDir: bin})
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	defer cluster.Remove()
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := cluster.Start(sctx); err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	store, err := os.MkdirTemp("", "jetbox-demo-nats-")
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	defer os.RemoveAll(store)
	srv, err := natsembed.Start(natsembed.Options{StoreDir: store})
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	defer natsembed.Stop(srv)
	natsURL := srv.ClientURL()
	httpAddr, err := freeAddr()
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}

	conn, err := pgx.Connect(sctx, cluster.DSN)
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(sctx, demoSchema); err != nil {
		fmt.Fprintln(stderr, "jetbox demo: create tables:", err)
		return exitFailure
	}
	say("  postgres  %s  (tables orders, outbox)", cluster.DSN)
	say("  nats      %s  (stream OUTBOX, subjects outbox.>)", natsURL)
	say("  jetbox    http://%s/metrics, /readyz", httpAddr)

	// The real forwarder, configured exactly as `jetbox run` would be.
	var c cli
	{
		var k *kong.Kong
		if k, err = kong.New(&c, kong.Name("jetbox"), kong.Vars(flagVars)); err == nil {
			_, err = k.Parse([]string{"run", "--postgres-url=" + cluster.DSN, "--nats-url=" + natsURL,
				"--http-addr=" + httpAddr, "--duplicate-window=10m", "--log-format=console", "--log-level=warn", "--source=table,messages"})
		}
	}
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	cfg, err := c.Run.Config()
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

	nc, err := nats.Connect(natsURL)
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	var stream jetstream.Stream
	for stream == nil { // the forwarder creates the stream at start-up
		if stream, err = js.Stream(sctx, "OUTBOX"); err != nil {
			select {
			case code := <-forwarderDone:
				fmt.Fprintln(stderr, "jetbox demo: the forwarder stopped at start-up")
				return code
			case <-sctx.Done():
				fmt.Fprintln(stderr, "jetbox demo: stream OUTBOX not created:", err)
				return exitFailure
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	received := make(chan struct{}, 1024)
	var printMu sync.Mutex
	cc, err := cons.Consume(func(m jetstream.Msg) {
		printMu.Lock()
		defer printMu.Unlock()
		printEvent(stdout, m)
		received <- struct{}{}
	})
	if err != nil {
		fmt.Fprintln(stderr, "jetbox demo:", err)
		return exitFailure
	}
	defer cc.Stop()

	say("\nWriting %d sample orders, each a business row and its event in one transaction: even ones with an outbox row,\nodd ones with SELECT jetbox_emit(...) (a logical decoding message, no table); each arrives from a JetStream consumer:\n", d.Orders)
	customers := []string{"ada", "grace", "linus", "barbara", "ken", "margaret"}
	for i := 0; i < d.Orders; i++ {
		producer := demoOrder
		if i%2 == 1 {
			producer = demoOrderMessage
		}
		if _, err := conn.Exec(ctx, producer, customers[i%len(customers)], 10+7*i); err != nil {
			if ctx.Err() != nil {
				return exitOK
			}
			fmt.Fprintln(stderr, "jetbox demo: write order:", err)
			return exitFailure
		}
		select {
		case <-ctx.Done():
			return exitOK
		case code := <-forwarderDone:
			fmt.Fprintln(stderr, "jetbox demo: the forwarder stopped")
			return code
		case <-time.After(d.Interval):
		}
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
	say("  psql %q -c \"INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '42', 'OrderShipped', '{\\\"carrier\\\": \\\"ups\\\"}')\"", cluster.DSN)
	say("  psql %q -c \"SELECT jetbox_emit('order', '42', 'OrderDelivered', '{}')\"", cluster.DSN)
	say("  nats --server %s sub 'outbox.>'          # live, as jetbox publishes", natsURL)
	say("  nats --server %s stream view OUTBOX      # everything stored", natsURL)
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
