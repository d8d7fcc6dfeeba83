module github.com/colibri-moe/colibri/deploy/helm/render

go 1.19

require (
	github.com/Masterminds/sprig/v3 v3.2.3
	gopkg.in/yaml.v2 v2.4.0
	gopkg.in/yaml.v3 v3.0.1
)
