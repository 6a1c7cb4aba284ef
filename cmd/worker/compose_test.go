package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// The module root, where docker-compose.yml and prometheus.yml live.
const moduleRoot = "../.."

// composeFile is the part of a Compose file (the Compose Specification) that
// docker-compose.yml uses. Decoding with KnownFields rejects any other key, so that a
// misspelt one ("enviroment") fails here rather than being ignored by Docker.
type composeFile struct {
	Services   map[string]composeService `yaml:"services"`
	Volumes    map[string]any            `yaml:"volumes"`
	Extensions map[string]any            `yaml:",inline"` // x-* keys: anchors for the services
}

type composeService struct {
	Image       string            `yaml:"image"`
	WorkingDir  string            `yaml:"working_dir"`
	Init        bool              `yaml:"init"`
	Entrypoint  []string          `yaml:"entrypoint"`
	Command     []string          `yaml:"command"`
	Environment map[string]string `yaml:"environment"`
	Volumes     []string          `yaml:"volumes"`
	Ports       []string          `yaml:"ports"`
	DependsOn   yaml.Node         `yaml:"depends_on"` // a list of names, or a map name -> condition
	Healthcheck map[string]any    `yaml:"healthcheck"`
	Restart     string            `yaml:"restart"`
	// StopGracePeriod is how long `docker compose stop` waits after SIGTERM before it
	// sends SIGKILL; Compose's default is 10s.
	StopGracePeriod string `yaml:"stop_grace_period"`
	// Profiles lists the profiles that start the service (docker compose --profile);
	// none: it always starts.
	Profiles []string `yaml:"profiles"`
}

// goService matches the entrypoint script of a service that builds a command of this
// module and execs it (so that it, not sh, gets SIGTERM), after Compose turned $$ into $:
// go build -o BIN ./cmd/NAME && exec BIN ["$@"].
var goService = regexp.MustCompile(`^go build -o (\S+) \./cmd/([a-z0-9_-]+) && exec (\S+)( "\$@")?$`)

// TestDockerCompose checks docker-compose.yml without Docker: the four services (Redis,
// the worker with metrics, Prometheus scraping it, the one-shot enqueue) exist, and the
// cluster profile (checkClusterProfile); each Go
// service builds a real command (a main package under cmd/) with a Go image as new as
// go.mod, and execs what it built; the command accepts the service's flags (run with
// them and -h, it exits 0); each variable is one the command reads (it lists it in
// -h; GO* variables are the go command's) with a value it accepts; Redis starts with the
// service's arguments; and prometheus.yml scrapes the worker's METRICS_ADDR port.
func TestDockerCompose(t *testing.T) {
	cf := readCompose(t)
	for _, name := range []string{"redis", "worker", "prometheus", "enqueue"} {
		if _, ok := cf.Services[name]; !ok {
			t.Errorf("docker-compose.yml has no service %q", name)
		}
	}
	for key := range cf.Extensions {
		if !strings.HasPrefix(key, "x-") {
			t.Errorf("docker-compose.yml: unknown top-level key %q", key)
		}
	}
	for name, svc := range cf.Services {
		for _, dep := range dependsOn(t, name, svc) {
			if _, ok := cf.Services[dep]; !ok {
				t.Errorf("service %s depends on %q, which is not a service", name, dep)
			}
		}
		for _, v := range svc.Volumes {
			src, _, _ := strings.Cut(v, ":")
			if !strings.HasPrefix(src, ".") && !strings.HasPrefix(src, "/") {
				if _, ok := cf.Volumes[src]; !ok {
					t.Errorf("service %s mounts the volume %q, which the top-level volumes do not declare", name, src)
				}
			} else if _, err := os.Stat(filepath.Join(moduleRoot, src)); err != nil {
				t.Errorf("service %s mounts %s: %v", name, src, err)
			}
		}
	}
	if t.Failed() {
		return
	}
	goEnv := goEnvNames(t)
	for _, name := range []string{"worker", "enqueue"} {
		t.Run(name, func(t *testing.T) { checkGoService(t, name, cf.Services[name], goEnv, []string{"redis:6379"}) })
	}
	if enq := cf.Services["enqueue"]; enq.Restart != "no" {
		t.Errorf(`enqueue: restart %q, want "no": it enqueues once and exits`, enq.Restart)
	}
	t.Run("redis", func(t *testing.T) {
		svc := cf.Services["redis"]
		if !strings.HasPrefix(svc.Image, "redis:") || len(svc.Command) == 0 || svc.Command[0] != "redis-server" {
			t.Fatalf("redis: image %q command %q, want a redis image running redis-server", svc.Image, svc.Command)
		}
		if slices.Contains(svc.Command, "--port") {
			t.Errorf("redis: --port in %q; the other services reach it at the default 6379", svc.Command)
		}
		// The local redis-server (the tests' prerequisite) must start with the same
		// arguments, after the helper's: an unknown option makes it exit.
		rdb := redistest.StartServer(t, svc.Command[1:]...).Client()
		if v, err := rdb.ConfigGet(t.Context(), "appendonly").Result(); err != nil || v["appendonly"] != "no" {
			t.Errorf("redis-server %q: appendonly %v (%v), want no", svc.Command[1:], v, err)
		}
	})
	t.Run("prometheus", func(t *testing.T) { checkPrometheus(t, cf) })
	t.Run("cluster", func(t *testing.T) { checkClusterProfile(t, cf, goEnv) })
}

// clusterNodes are the Redis Cluster nodes of the cluster profile: 3 primaries, then 3
// replicas (redis-cli --cluster create --cluster-replicas 1 makes the first 3 primaries).
var clusterNodes = []string{"redis-node-1", "redis-node-2", "redis-node-3", "redis-node-4", "redis-node-5", "redis-node-6"}

// checkClusterProfile checks the cluster profile: 6 redis-server nodes in cluster mode
// (a local redis-server starts with each one's arguments and reports cluster_enabled:1);
// redis-cluster-init, run once after all are healthy, that creates the cluster from all
// 6 with one replica each unless it is already up; and worker-cluster and enqueue-cluster,
// the worker and enqueue services with REDIS_ADDR listing the 3 primaries, started after
// it. Every service of the profile is only in it, and the default services in none.
func checkClusterProfile(t *testing.T, cf composeFile, goEnv map[string]bool) {
	profile := append(slices.Clone(clusterNodes), "redis-cluster-init", "worker-cluster", "enqueue-cluster")
	for name, svc := range cf.Services {
		want := []string(nil)
		if slices.Contains(profile, name) {
			want = []string{"cluster"}
		}
		if !slices.Equal(svc.Profiles, want) {
			t.Errorf("service %s: profiles %q, want %q", name, svc.Profiles, want)
		}
	}
	for _, name := range clusterNodes {
		svc, ok := cf.Services[name]
		if !ok {
			t.Fatalf("no service %s", name)
		}
		if !strings.HasPrefix(svc.Image, "redis:") || len(svc.Command) < 2 || svc.Command[0] != "redis-server" || len(svc.Healthcheck) == 0 {
			t.Errorf("%s: image %q command %q healthcheck %v; want redis-server with a healthcheck", name, svc.Image, svc.Command, svc.Healthcheck)
			continue
		}
		if slices.Contains(svc.Command, "--port") {
			t.Errorf("%s: --port in %q; the others reach it at the default 6379", name, svc.Command)
		}
		if !slices.Equal(svc.Command, cf.Services[clusterNodes[0]].Command) {
			t.Errorf("%s: command %q, want %s's", name, svc.Command, clusterNodes[0])
		}
	}
	// A local redis-server starts with a node's arguments (after the helper's, which set
	// its port and directory) and is in cluster mode.
	rdb := redistest.StartServer(t, cf.Services[clusterNodes[0]].Command[1:]...).Client()
	if info, err := rdb.Info(t.Context(), "cluster").Result(); err != nil || !strings.Contains(info, "cluster_enabled:1") {
		t.Errorf("redis-server %q: INFO cluster %q, %v; want cluster_enabled:1", cf.Services[clusterNodes[0]].Command[1:], info, err)
	}

	initSvc := cf.Services["redis-cluster-init"]
	script := ""
	if len(initSvc.Entrypoint) == 3 && initSvc.Entrypoint[0] == "sh" && initSvc.Entrypoint[1] == "-c" {
		script = strings.ReplaceAll(initSvc.Entrypoint[2], "$$", "$")
	}
	create := regexp.MustCompile(`^redis-cli -h redis-node-1 cluster info \| grep -q cluster_state:ok \|\| ` +
		`redis-cli --cluster create \$\(for n in 1 2 3 4 5 6; do echo \$\(getent hosts redis-node-\$n \| cut -d' ' -f1\):6379; done\) ` +
		`--cluster-replicas 1 --cluster-yes$`)
	if !create.MatchString(script) || !strings.HasPrefix(initSvc.Image, "redis:") {
		t.Errorf("redis-cluster-init: image %q entrypoint %q; want a redis image that creates the cluster of all 6 nodes with 1 replica each, unless it is up", initSvc.Image, initSvc.Entrypoint)
	}
	if initSvc.Restart != "no" {
		t.Errorf(`redis-cluster-init: restart %q, want "no": it runs once`, initSvc.Restart)
	}
	deps := conditions(t, "redis-cluster-init", initSvc)
	for _, n := range clusterNodes {
		if deps[n] != "service_healthy" {
			t.Errorf("redis-cluster-init: depends on %s %q, want service_healthy", n, deps[n])
		}
	}
	if len(deps) != len(clusterNodes) {
		t.Errorf("redis-cluster-init depends on %v, want the 6 nodes only", deps)
	}

	for _, name := range []string{"worker-cluster", "enqueue-cluster"} {
		svc := cf.Services[name]
		cmdName, _, _ := strings.Cut(name, "-")
		t.Run(name, func(t *testing.T) {
			if deps := conditions(t, name, svc); len(deps) != 1 || deps["redis-cluster-init"] != "service_completed_successfully" {
				t.Errorf("depends on %v, want redis-cluster-init: service_completed_successfully only", deps)
			}
			checkGoService(t, cmdName, svc, goEnv, []string{"redis-node-1:6379", "redis-node-2:6379", "redis-node-3:6379"})
		})
	}
	// The cluster worker is the worker with another Redis, and its metrics on another
	// host port (Prometheus scrapes the default worker only).
	w, wc := cf.Services["worker"], cf.Services["worker-cluster"]
	for k, v := range w.Environment {
		if k != "REDIS_ADDR" && wc.Environment[k] != v {
			t.Errorf("worker-cluster: %s=%q, want the worker's %q", k, wc.Environment[k], v)
		}
	}
	if slices.Equal(w.Ports, wc.Ports) {
		t.Errorf("worker-cluster publishes %q, as the worker does: both could not run at once", wc.Ports)
	}
}

// conditions returns what svc depends on, by service, with its condition; the list form
// has no conditions ("").
func conditions(t *testing.T, name string, svc composeService) map[string]string {
	t.Helper()
	out := map[string]string{}
	if svc.DependsOn.Kind == yaml.MappingNode {
		var m map[string]struct {
			Condition string `yaml:"condition"`
		}
		if err := svc.DependsOn.Decode(&m); err != nil {
			t.Fatalf("service %s: depends_on: %v", name, err)
		}
		for dep, c := range m {
			out[dep] = c.Condition
		}
		return out
	}
	for _, dep := range dependsOn(t, name, svc) {
		out[dep] = ""
	}
	return out
}

// readCompose decodes docker-compose.yml, failing t on an unknown key.
func readCompose(t *testing.T) composeFile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(moduleRoot, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var cf composeFile
	if err := dec.Decode(&cf); err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	return cf
}

// dependsOn lists the services that svc depends on, in either of Compose's forms.
func dependsOn(t *testing.T, name string, svc composeService) []string {
	t.Helper()
	var names []string
	switch svc.DependsOn.Kind {
	case 0: // absent
	case yaml.SequenceNode:
		if err := svc.DependsOn.Decode(&names); err != nil {
			t.Errorf("service %s: depends_on: %v", name, err)
		}
	case yaml.MappingNode:
		var m map[string]struct {
			Condition string `yaml:"condition"`
		}
		if err := svc.DependsOn.Decode(&m); err != nil {
			t.Errorf("service %s: depends_on: %v", name, err)
		}
		for dep, c := range m {
			if c.Condition != "service_started" && c.Condition != "service_healthy" && c.Condition != "service_completed_successfully" {
				t.Errorf("service %s: depends_on %s: condition %q", name, dep, c.Condition)
			}
			names = append(names, dep)
		}
	default:
		t.Errorf("service %s: depends_on is neither a list nor a map", name)
	}
	return names
}

// checkGoService checks a service that builds and runs the command cmd/<name> with
// REDIS_ADDR listing addrs.
func checkGoService(t *testing.T, name string, svc composeService, goEnv map[string]bool, addrs []string) {
	if len(svc.Entrypoint) < 3 || svc.Entrypoint[0] != "sh" || svc.Entrypoint[1] != "-c" {
		t.Fatalf("entrypoint %q, want [sh -c SCRIPT ...]", svc.Entrypoint)
	}
	m := goService.FindStringSubmatch(strings.ReplaceAll(svc.Entrypoint[2], "$$", "$"))
	if m == nil {
		t.Fatalf("entrypoint script %q does not match %s", svc.Entrypoint[2], goService)
	}
	bin, cmdName, execd, passesArgs := m[1], m[2], m[3], m[4] != ""
	if cmdName != name || execd != bin {
		t.Errorf("builds ./cmd/%s to %s and execs %s; want ./cmd/%s, exec'd as built", cmdName, bin, execd, name)
	}
	if len(svc.Command) > 0 && !passesArgs {
		t.Errorf(`command %q is ignored: the script does not pass "$@" on`, svc.Command)
	}
	if !slices.Contains(svc.Volumes, ".:"+svc.WorkingDir+":ro") && !slices.Contains(svc.Volumes, ".:"+svc.WorkingDir) {
		t.Errorf("volumes %q do not mount the checkout at working_dir %q, where ./cmd/%s is built", svc.Volumes, svc.WorkingDir, cmdName)
	}
	if want := "golang:" + goModMinor(t); svc.Image != want {
		t.Errorf("image %q, want %q (go.mod's go version)", svc.Image, want)
	}

	// Run the command as the service does: its GO* variables are the go command's.
	var goVars, vars []string
	for k, v := range svc.Environment {
		if strings.HasPrefix(k, "GO") {
			if !goEnv[k] {
				t.Errorf("variable %s: not one of the go command's (go env)", k)
			}
			goVars = append(goVars, k+"="+v)
		} else {
			vars = append(vars, k)
		}
	}
	out := commandHelp(t, cmdName, svc.Command, goVars)
	// Its variables: each one listed in its -h, with a value the command accepts.
	for _, k := range vars {
		if !regexp.MustCompile(`\b` + k + `\b`).MatchString(out) {
			t.Errorf("variable %s: %s -h does not mention it, so it does not read it", k, cmdName)
		}
	}
	clearEnv(t)
	for k, v := range svc.Environment {
		t.Setenv(k, v)
	}
	rc, err := redisenv.Load() // every command reads REDIS_* through redisenv
	if err != nil {
		t.Errorf("environment: %v", err)
	} else if got := rc.Addrs(); !slices.Equal(got, addrs) {
		t.Errorf("REDIS_ADDR %q, want %q", rc.Addr, strings.Join(addrs, ","))
	}

	if cmdName == "worker" {
		cfg, err := loadConfig()
		if err != nil {
			t.Fatalf("environment: %v", err)
		}
		if cfg.MetricsAddr == "" {
			t.Errorf("METRICS_ADDR is not set: Prometheus has nothing to scrape")
		}
		// SIGKILL must not come before the running tasks have had their shutdown timeout.
		grace := 10 * time.Second
		if svc.StopGracePeriod != "" {
			if grace, err = time.ParseDuration(svc.StopGracePeriod); err != nil {
				t.Errorf("stop_grace_period: %v", err)
			}
		}
		if grace <= cfg.ShutdownTimeout {
			t.Errorf("stop_grace_period %s is not longer than WORKER_SHUTDOWN_TIMEOUT %s: Docker would kill running tasks", grace, cfg.ShutdownTimeout)
		}
	}
}

// commandHelp runs cmd/<name> with args and then -h, which the flag package reaches only
// if every argument before it is a flag the command defines, with a valid value, and
// returns what it printed. The worker runs in this process (run); other commands are
// built as the service builds them, with its GO* variables goVars (and -race if this test
// has it, so that the build reuses the packages compiled for the test).
func commandHelp(t *testing.T, name string, args, goVars []string) string {
	t.Helper()
	args = append(slices.Clone(args), "-h")
	if name == "worker" {
		clearEnv(t)
		var stdout, stderr bytes.Buffer
		if code := run(t.Context(), args, &stdout, &stderr); code != exitOK {
			t.Fatalf("worker %q: exit status %d (the flags are not all the command's)\n%s%s", args, code, &stdout, &stderr)
		}
		return stdout.String() + stderr.String()
	}
	path := filepath.Join(t.TempDir(), name)
	buildArgs := []string{"build", "-o", path}
	if raceEnabled {
		buildArgs = append(buildArgs, "-race")
	}
	build := exec.Command("go", append(buildArgs, "./cmd/"+name)...)
	build.Dir = moduleRoot
	build.Env = append(os.Environ(), goVars...)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/%s with %q: %v\n%s", name, goVars, err, out)
	}
	help := exec.Command(path, args...)
	help.Env = []string{"PATH=" + os.Getenv("PATH")}
	out, err := help.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %q: %v (the flags are not all the command's)\n%s", name, args, err, out)
	}
	return string(out)
}

// checkPrometheus checks the prometheus service and prometheus.yml: it scrapes the worker
// service at the port of the worker's METRICS_ADDR, which the worker publishes.
func checkPrometheus(t *testing.T, cf composeFile) {
	svc := cf.Services["prometheus"]
	if !strings.HasPrefix(svc.Image, "prom/prometheus:v") {
		t.Errorf("image %q, want prom/prometheus:v<version>", svc.Image)
	}
	// The image's own command reads /etc/prometheus/prometheus.yml; Prometheus is not here
	// to check other flags.
	if len(svc.Command) > 0 || len(svc.Entrypoint) > 0 {
		t.Errorf("command %q entrypoint %q: keep the image's, which reads /etc/prometheus/prometheus.yml", svc.Command, svc.Entrypoint)
	}
	if !slices.Contains(svc.Volumes, "./prometheus.yml:/etc/prometheus/prometheus.yml:ro") {
		t.Errorf("volumes %q do not mount ./prometheus.yml at /etc/prometheus/prometheus.yml", svc.Volumes)
	}
	_, metricsPort, err := net.SplitHostPort(cf.Services["worker"].Environment["METRICS_ADDR"])
	if err != nil {
		t.Fatalf("worker METRICS_ADDR: %v", err)
	}
	published := false
	for _, p := range cf.Services["worker"].Ports {
		published = published || strings.HasSuffix(p, ":"+metricsPort)
	}
	if !published {
		t.Errorf("worker ports %q do not publish the metrics port %s", cf.Services["worker"].Ports, metricsPort)
	}

	data, err := os.ReadFile(filepath.Join(moduleRoot, "prometheus.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var pc struct {
		Global struct {
			ScrapeInterval     string `yaml:"scrape_interval"`
			EvaluationInterval string `yaml:"evaluation_interval"`
		} `yaml:"global"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			MetricsPath   string `yaml:"metrics_path"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&pc); err != nil {
		t.Fatalf("prometheus.yml: %v", err)
	}
	for _, d := range []string{pc.Global.ScrapeInterval, pc.Global.EvaluationInterval} {
		if _, err := time.ParseDuration(d); err != nil {
			t.Errorf("prometheus.yml: interval %q: %v", d, err)
		}
	}
	want := "worker:" + metricsPort
	found := false
	for _, sc := range pc.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			if slices.Contains(st.Targets, want) {
				found = true
				if sc.MetricsPath != "" && sc.MetricsPath != "/metrics" {
					t.Errorf("job %s: metrics_path %q; the worker serves /metrics", sc.JobName, sc.MetricsPath)
				}
			}
		}
	}
	if !found {
		t.Errorf("prometheus.yml scrapes no target %s (the worker service at its METRICS_ADDR port)", want)
	}
}

// goModMinor returns go.mod's go version as major.minor, e.g. "1.26".
func goModMinor(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(moduleRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(data)
	if m == nil {
		t.Fatal("go.mod has no go line")
	}
	return string(m[1])
}

// goEnvNames returns the names of the go command's environment variables (go env -json).
func goEnvNames(t *testing.T) map[string]bool {
	t.Helper()
	out, err := exec.Command("go", "env", "-json").Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		t.Fatalf("go env -json: %v\n%s", err, ee.Stderr)
	} else if err != nil {
		t.Fatalf("go env -json: %v", err)
	}
	var env map[string]string
	if err := json.Unmarshal(out, &env); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for k := range env {
		names[k] = true
	}
	return names
}
