"""What a run reports: metrics and their names, busy timelines, health checks, the dashboard."""
