package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/jetbox-dev/jetbox/internal/natsembed"
)

// The bench runs the NATS server, the polling relay and the bare forwarder
// in child processes of its own binary, so their CPU time can be read apart
// from the bench's (the load generators and consumers). roleEnv names the child's role; the test
// binary honours it too (see TestMain), so the test runs the same way.
const roleEnv = "JETBOX_BENCH_ROLE"

// Child roles.
const (
	roleNATS  = "nats-server"
	roleRelay = "polling-relay"
	roleBare  = "bare-forwarder"
)

// runChild runs a child role until SIGTERM or SIGINT, and returns its exit code.
func runChild(role string, args []string, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var err error
	switch role {
	case roleNATS:
		err = runNATSChild(ctx, args)
	case roleRelay:
		err = runRelayChild(ctx, args)
	case roleBare:
		err = runBareChild(ctx, args)
	default:
		err = fmt.Errorf("unknown %s=%q", roleEnv, role)
	}
	if err != nil {
		fmt.Fprintf(stderr, "jetbox-bench %s: %v\n", role, err)
		return 1
	}
	return 0
}

// runNATSChild serves an embedded NATS server with JetStream (file storage)
// until ctx ends.
func runNATSChild(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(roleNATS, flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:4222", "host:port to serve clients on")
	store := fs.String("store", "", "JetStream store directory")
	if err := fs.Parse(args); err != nil {
		return err
	}
	host, portText, err := net.SplitHostPort(*listen)
	if err != nil {
		return fmt.Errorf("-listen %s: %w", *listen, err)
	}
	port, err := strconv.Atoi(portText)
	if err != nil {
		return fmt.Errorf("-listen %s: %w", *listen, err)
	}
	srv, err := natsembed.Start(natsembed.Options{Host: host, Port: port, StoreDir: *store})
	if err != nil {
		return err
	}
	fmt.Fprintln(os.Stdout, "serving", srv.ClientURL())
	<-ctx.Done()
	natsembed.Stop(srv)
	return nil
}
