.PHONY: help test bench demo lint

help: ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-6s %s\n", $$1, $$2}'

test: ## the README's test command (needs redis-server on PATH)
	go test -race -count=1 ./...

bench: ## limiter decisions/s against PING, side by side
	go test ./throttle -run '^$$' -bench . -benchtime 2s

demo: ## the one-command quickstart on an embedded Redis
	go run ./cmd/demo

lint: ## gofmt and go vet
	@test -z "$$(gofmt -l .)" || { gofmt -l .; exit 1; }
	go vet ./...
