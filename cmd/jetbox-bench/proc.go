package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTick is the unit of the CPU times in /proc/PID/stat (USER_HZ). Linux
// has used 100 on every architecture Go supports for decades; reading the
// real value needs sysconf(_SC_CLK_TCK), i.e. cgo.
const clockTick = 10 * time.Millisecond

// procStat is the part of /proc/PID/stat the bench uses.
type procStat struct {
	ppid int
	// self is utime+stime; children is cutime+cstime: the CPU of the
	// children the process waited for (Postgres' postmaster reaps its
	// backends, so their time ends up here when they exit).
	self, children time.Duration
	// kernel is stime alone: self's part spent in the kernel (system calls,
	// page faults).
	kernel time.Duration
	// minorFaults counts the page faults served without I/O: memory the
	// process touched for the first time, or again after the kernel took it.
	minorFaults int64
}

// readProcStat parses /proc/PID/stat.
func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, fmt.Errorf("read stat of pid %d: %w", pid, err)
	}
	return parseProcStat(b)
}

// parseProcStat parses the text of /proc/PID/stat. The command name (field 2)
// is in parentheses and may hold spaces, so fields are counted from the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	end := bytes.LastIndexByte(b, ')')
	if end < 0 {
		return procStat{}, errors.New("parse /proc stat: no command name")
	}
	f := strings.Fields(string(b[end+1:]))
	// f[0] is field 3 (state): ppid is field 4, minflt field 10, utime..cstime
	// fields 14..17.
	if len(f) < 15 {
		return procStat{}, fmt.Errorf("parse /proc stat: %d fields", len(f)+2)
	}
	var n [6]int64
	for i, idx := range []int{1, 11, 12, 13, 14, 7} {
		v, err := strconv.ParseInt(f[idx], 10, 64)
		if err != nil {
			return procStat{}, fmt.Errorf("parse /proc stat field %d: %w", idx+3, err)
		}
		n[i] = v
	}
	return procStat{ppid: int(n[0]), self: time.Duration(n[1]+n[2]) * clockTick,
		children: time.Duration(n[3]+n[4]) * clockTick, kernel: time.Duration(n[2]) * clockTick, minorFaults: n[5]}, nil
}

// processCPU is the CPU time (user + system) a running process used so far.
func processCPU(pid int) (time.Duration, error) {
	st, err := readProcStat(pid)
	return st.self, err
}

// treeCPU is the CPU time of a server that forks a process per connection
// (Postgres): the parent's own, its live children's, and that of the children
// it already reaped. The difference of two readings is what the server spent
// in between, including backends that started and ended meanwhile.
func treeCPU(parent int) (time.Duration, error) {
	st, err := readProcStat(parent)
	if err != nil {
		return 0, err
	}
	total := st.self + st.children
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, fmt.Errorf("list /proc: %w", err)
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == parent {
			continue
		}
		c, err := readProcStat(pid)
		if err != nil || c.ppid != parent {
			continue // gone meanwhile, or not a child
		}
		total += c.self
	}
	return total, nil
}

// peakRSS returns a process's peak resident set size (VmHWM) in bytes.
func peakRSS(pid int) (int64, error) {
	st, err := readKeyed(fmt.Sprintf("/proc/%d/status", pid), ":")
	if err != nil {
		return 0, err
	}
	kb, ok := st["VmHWM"]
	if !ok {
		return 0, fmt.Errorf("pid %d: no VmHWM in /proc status", pid)
	}
	return kb * 1024, nil
}

// process is a child process the bench started: jetbox, the NATS server, the
// polling relay or pg_recvlogical. Its output goes to a log file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	started time.Time
	done    chan struct{} // closed once the process exited and was reaped
	waitErr error         // Wait's result, valid once done is closed
}

// startProcess starts bin with args and env (added to the bench's own
// environment), its stdout and stderr appended to logPath. The child is
// killed if the bench dies (Pdeathsig) and gets its own process group, so a
// Ctrl-C in the terminal reaches only the bench, which stops children in order.
func startProcess(name, logPath string, env []string, bin string, args ...string) (*process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open log of %s: %w", name, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	p.started = time.Now()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	go func() {
		p.waitErr = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// pid is the process id.
func (p *process) pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// cpu is the CPU time the process used so far; after it exited, its total.
func (p *process) cpu() (time.Duration, error) {
	if p.exited() {
		return p.cmd.ProcessState.UserTime() + p.cmd.ProcessState.SystemTime(), nil
	}
	return processCPU(p.pid())
}

// kernelCPU is the part of cpu spent in the kernel (system time).
func (p *process) kernelCPU() (time.Duration, error) {
	if p.exited() {
		return p.cmd.ProcessState.SystemTime(), nil
	}
	st, err := readProcStat(p.pid())
	return st.kernel, err
}

// stop sends SIGTERM, waits up to timeout for the process to exit, then
// kills it. It returns the exit error (nil for exit code 0), or an error
// saying it had to be killed. Calling it on an exited process is fine.
func (p *process) stop(timeout time.Duration) error {
	if !p.exited() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-p.done:
		if p.waitErr != nil {
			return fmt.Errorf("%s exited: %w", p.name, p.waitErr)
		}
		return nil
	case <-time.After(timeout):
		p.kill()
		return fmt.Errorf("%s did not stop within %s after SIGTERM: killed", p.name, timeout)
	}
}

// kill sends SIGKILL to the process group and waits until the process is gone.
func (p *process) kill() {
	if !p.exited() {
		_ = syscall.Kill(-p.pid(), syscall.SIGKILL)
	}
	<-p.done
}

// logTail returns the last n bytes of the process's log.
func (p *process) logTail(n int) string {
	b, _ := os.ReadFile(p.logPath)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}

// postmasterPID reads the postmaster's pid from a data directory.
func postmasterPID(dataDir string) (int, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return 0, fmt.Errorf("read postmaster.pid: %w", err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return 0, fmt.Errorf("parse postmaster.pid: %w", err)
	}
	return pid, nil
}
