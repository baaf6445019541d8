// Package pgcluster runs a throwaway PostgreSQL cluster: initdb on a temp
// dir, wal_level=logical, loopback only, no Unix socket. When the caller is
// root it runs the server as the unprivileged user "nobody" (initdb and
// postgres refuse root). Tests and `jetbox demo` use it.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// FindBinDir finds the server binaries: $JETBOX_PG_BINDIR, the newest
// /usr/lib/postgresql/*/bin, then initdb on PATH.
func FindBinDir() (string, error) {
	if d := os.Getenv("JETBOX_PG_BINDIR"); d != "" {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err != nil {
			return "", fmt.Errorf("JETBOX_PG_BINDIR=%s has no initdb: point it at the PostgreSQL server's bin directory", d)
		}
		return d, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return major(dirs[i]) > major(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	return "", errors.New("PostgreSQL server binaries (initdb, postgres) not found on PATH, in /usr/lib/postgresql/*/bin or in $JETBOX_PG_BINDIR: install them (Debian: apt-get install postgresql-15) or set JETBOX_PG_BINDIR")
}

func major(binDir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return n
}

// Options configure a cluster.
type Options struct {
	BinDir   string   // from FindBinDir
	Port     int      // 0: a free port
	Settings []string // extra "name=value" server settings, applied last
	// Template is a data directory made by InitTemplate to copy instead of
	// running initdb (faster when many clusters are made).
	Template string
}

// Cluster is one PostgreSQL server and its data directory.
type Cluster struct {
	opts   Options
	dir    string
	data   string
	cred   *syscall.Credential
	cmd    *exec.Cmd
	exited chan struct{}
	// Port is the TCP port on 127.0.0.1; DSN connects as superuser postgres.
	Port int
	DSN  string
	// LogPath is the server log.
	LogPath string
}

// credential returns who runs the server: nil (the caller) or "nobody" for root.
func credential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("nobody")
	if err != nil {
		return nil, fmt.Errorf("running as root needs an unprivileged user to run postgres as: %w (create user nobody)", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

func ownedTempDir(cred *syscall.Credential, pattern string) (string, error) {
	dir, err := os.MkdirTemp("", pattern)
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return "", err
		}
	}
	return dir, nil
}

func initdb(bin, data string, cred *syscall.Credential) error {
	cmd := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8", "--locale=C")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %v\n%s", err, out)
	}
	return nil
}

// InitTemplate runs initdb once into a new temp dir and returns the data
// directory, for Options.Template.
func InitTemplate(bin string) (string, error) {
	cred, err := credential()
	if err != nil {
		return "", err
	}
	dir, err := ownedTempDir(cred, "jetbox-pgtemplate-")
	if err != nil {
		return "", err
	}
	data := filepath.Join(dir, "data")
	return data, initdb(bin, data, cred)
}

// New creates the cluster's data directory (it does not start the server).
func New(opts Options) (*Cluster, error) {
	cred, err := credential()
	if err != nil {
		return nil, err
	}
	dir, err := ownedTempDir(cred, "jetbox-pg-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{opts: opts, dir: dir, data: filepath.Join(dir, "data"), cred: cred, LogPath: filepath.Join(dir, "postgres.log")}
	if opts.Template != "" {
		if out, err := exec.Command("cp", "-a", opts.Template, c.data).CombinedOutput(); err != nil {
			c.Remove()
			return nil, fmt.Errorf("copy template cluster: %v\n%s", err, out)
		}
	} else if err := initdb(opts.BinDir, c.data, cred); err != nil {
		c.Remove()
		return nil, err
	}
	c.Port = opts.Port
	if c.Port == 0 {
		if c.Port, err = freePort(); err != nil {
			c.Remove()
			return nil, err
		}
	}
	c.DSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.Port)
	return c, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Start starts the server and waits (bounded by ctx) until it accepts connections.
func (c *Cluster) Start(ctx context.Context) error {
	if c.cmd != nil {
		return errors.New("postgres already running")
	}
	logf, err := os.OpenFile(c.LogPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	args := []string{"-D", c.data, "-p", strconv.Itoa(c.Port),
		"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
		"-c", "wal_level=logical", "-c", "max_wal_senders=20", "-c", "max_replication_slots=20",
		"-c", "fsync=off", "-c", "max_connections=60", "-c", "log_min_messages=warning",
		"-c", "wal_sender_timeout=30s"}
	for _, s := range c.opts.Settings {
		args = append(args, "-c", s)
	}
	cmd := exec.Command(filepath.Join(c.opts.BinDir, "postgres"), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Setpgid: true}
	cmd.Dir = c.dir // a directory the server's user may enter
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start postgres: %w", err)
	}
	c.cmd, c.exited = cmd, make(chan struct{})
	go func(exited chan struct{}) { _ = cmd.Wait(); logf.Close(); close(exited) }(c.exited)
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgx.Connect(pctx, c.DSN)
		cancel()
		if err == nil {
			conn.Close(context.Background())
			return nil
		}
		select {
		case <-c.exited:
			c.cmd = nil
			return fmt.Errorf("postgres exited at start:\n%s", c.LogTail(4096))
		case <-ctx.Done():
			c.Stop("immediate")
			return fmt.Errorf("postgres not ready: %w (last: %v)", ctx.Err(), err)
		case <-time.After(50 * time.Millisecond): // readiness has no event to wait on
		}
	}
}

// AddSettings adds "name=value" server settings, applied after the others
// from the next Start on.
func (c *Cluster) AddSettings(settings ...string) {
	c.opts.Settings = append(c.opts.Settings, settings...)
}

// Stop stops the server: "smart" (SIGTERM), "fast" (SIGINT) or "immediate"
// (SIGQUIT: a crash, recovery at the next start). It is a no-op when stopped.
func (c *Cluster) Stop(mode string) error {
	if c.cmd == nil {
		return nil
	}
	sig, ok := map[string]syscall.Signal{"smart": syscall.SIGTERM, "fast": syscall.SIGINT, "immediate": syscall.SIGQUIT}[mode]
	if !ok {
		return fmt.Errorf("unknown stop mode %q", mode)
	}
	_ = c.cmd.Process.Signal(sig)
	select {
	case <-c.exited:
	case <-time.After(60 * time.Second):
		_ = syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
		<-c.exited
	}
	c.cmd = nil
	return nil
}

// Remove stops the server and deletes its files.
func (c *Cluster) Remove() {
	_ = c.Stop("immediate")
	_ = os.RemoveAll(c.dir)
}

// DataDir is the cluster's data directory.
func (c *Cluster) DataDir() string { return c.data }

// LogTail returns the last n bytes of the server log.
func (c *Cluster) LogTail(n int) string {
	b, _ := os.ReadFile(c.LogPath)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}
