-- Run once by the postgres image on an empty data volume: one database for MLflow, one for Prefect.
CREATE DATABASE mlflow;
CREATE DATABASE prefect;
