package main

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"time"

	"github.com/alecthomas/kong"
)

// AfterApply is a kong hook, run once the flags are parsed. It lets
// --nats-context's URL apply when --nats-url is not given (see
// clearDefaultNatsURL), and with --pprof-addr
// set it serves Go's profiler there for the life of the process (for
// cmd/jetbox-bench and for looking into a live jetbox). It lives here rather
// than in run so that profiling stays out of the forwarder's code. The
// commands that embed RunFlags (check, status) get it too.
func (f *RunFlags) AfterApply(kctx *kong.Context) error {
	f.clearDefaultNatsURL(kctx)
	if f.PprofAddr == "" {
		return nil
	}
	return servePprof(f.PprofAddr)
}

// servePprof listens on addr and serves /debug/pprof/ in the background.
func servePprof(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on --pprof-addr %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintln(os.Stderr, "jetbox: pprof server:", err)
		}
	}()
	return nil
}
