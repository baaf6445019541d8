package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"
)

// profiledCatchup repeats the catch-up in delivery mode with jetbox's
// --pprof-addr on and records a CPU profile of jetbox while it drains the
// backlog. It is a run of its own so that profiling does not touch the
// figures of the main runs.
func (b *bench) profiledCatchup(ctx context.Context, mode string) (*throughput, string, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	path := filepath.Join(b.dir, "jetbox-cpu-"+mode+".pprof")
	// Long enough for the whole drain; idle time adds no samples.
	secs := 2 + b.cfg.Rows/40_000
	var wg sync.WaitGroup
	var profErr error
	opts := catchupOpts{
		env: []string{"JETBOX_PPROF_ADDR=" + addr},
		onStart: func(p *process) {
			wg.Go(func() { profErr = fetchProfile(ctx, p, addr, secs, path) })
		},
		beforeStop: wg.Wait, // the profile needs jetbox until it is written
	}
	res, _ := b.jetboxCatchup(ctx, "jetbox, --delivery="+mode+", under the CPU profiler", newDeployment(map[string]string{"dedup": "profile", "exactly-once": "profilex"}[mode], mode),
		b.cfg.Rows, b.cfg.TxRows, opts)
	wg.Wait()
	if profErr != nil {
		_ = os.Remove(path)
		return res, "", profErr
	}
	return res, path, nil
}

// fetchProfile waits until jetbox (p) serves pprof on addr, then records a
// CPU profile of secs seconds into path.
func fetchProfile(ctx context.Context, p *process, addr string, secs int, path string) error {
	base := "http://" + addr + "/debug/pprof/"
	for {
		resp, err := http.Get(base)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
			err = fmt.Errorf("GET %s: %s", base, resp.Status)
		}
		if p.exited() || ctx.Err() != nil || time.Since(p.started) > 10*time.Second {
			return fmt.Errorf("jetbox serves no pprof on --pprof-addr %s (a jetbox without that flag?): %w", addr, err)
		}
		time.Sleep(5 * time.Millisecond) // the listener has no event to wait on
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("%sprofile?seconds=%d", base, secs), nil)
	if err != nil {
		return fmt.Errorf("profile request: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("fetch CPU profile: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetch CPU profile: %s", resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("create %s: %w", path, err)
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// runOutput runs bin with args and returns its standard output.
func runOutput(bin string, args ...string) (string, error) {
	out, err := exec.Command(bin, args...).Output()
	if err != nil {
		return "", fmt.Errorf("%s %v: %w", bin, args, err)
	}
	return string(out), nil
}
